"""Bad input gets a ValueError naming the field and the value, before any device work."""
import numpy as np
import pytest
import torch

from vllm_gaudi_unified import Bucket, PlanOptions, build_unified_batch, unified_attention

TABLE = np.array([[0, 1, 2], [3, 4, 5]])


@pytest.mark.parametrize("args, match", [
    (([1, 2], [0], TABLE, 4), "context_lens has 1 entries but query_lens has 2"),
    (([1, 0], [0, 0], TABLE, 4), r"query_lens\[1\] = 0 must be >= 1"),
    (([1, 1], [0, -3], TABLE, 4), r"context_lens\[1\] = -3 must be >= 0"),
    (([], [], np.zeros((0, 3), int), 4), "query_lens is empty"),
    (([1, 1], [0, 0], TABLE[:1], 4), r"block_table must have shape \[2, max_blocks\]"),
    (([1, 1], [0, 0], TABLE, 0), "block_size must be an int >= 1, got 0"),
    (([1, 1], [4, 20], TABLE, 4), r"block_table has 3 columns but request 1 needs 5 blocks for context_lens\[1\] = 20"),
    (([1, 1], [4, 5], np.array([[0, 1, 2], [3, -1, 5]]), 4), r"block_table\[1, 1\] = -1 is needed .* >= 0"),
    (([1.5, 1], [0, 0], TABLE, 4), "query_lens must hold integers"),
    (([[1], [1]], [0, 0], TABLE, 4), "query_lens must be 1-D"),
])
def test_bad_steps(args, match):
    with pytest.raises(ValueError, match=match):
        build_unified_batch(*args)


def test_block_id_out_of_range_with_num_blocks():
    with pytest.raises(ValueError, match=r"block_table\[1, 0\] = 3 is needed .* < num_blocks 3"):
        build_unified_batch([1, 1], [4, 4], TABLE, 4, num_blocks=3)


def test_unused_table_entries_are_ignored():
    table = np.array([[0, 99999, -7], [3, -1, -1]])
    assert build_unified_batch([1, 1], [4, 2], table, 4, num_blocks=6).max_block_id == 3


@pytest.mark.parametrize("kwargs, match", [
    (dict(sliding_window=0), "sliding_window must be None or an int >= 1, got 0"),
    (dict(num_blocks=0), "num_blocks must be None or an int >= 1"),
])
def test_bad_planner_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        build_unified_batch([1], [0], [[0]], 4, **kwargs)


@pytest.mark.parametrize("kwargs, match", [
    (dict(causal_tile=0), r"causal_tile must be an int in \[1, 4096\], got 0"),
    (dict(unique_layout="dense"), "unique_layout must be one of"),
    (dict(slice_min_density=2.0), "slice_min_density must be a float in"),
])
def test_bad_plan_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PlanOptions(**kwargs)


@pytest.mark.parametrize("kwargs, match", [
    (dict(query_len=-1), "Bucket.query_len must be a non-negative int, got -1"),
    (dict(phase="c--"), "Bucket.phase 'c--' disagrees with its sizes"),
])
def test_bad_buckets(kwargs, match):
    fields = dict(phase="-su", query_len=4, num_shared_blocks=2, num_unique_blocks=2, num_logits=2)
    with pytest.raises(ValueError, match=match):
        Bucket(**{**fields, **kwargs})


def test_bucket_too_small_names_the_dimension():
    with pytest.raises(ValueError, match="query_len 2 > 1"):
        build_unified_batch([1, 1], [4, 4], TABLE, 4, bucket=Bucket("--u", 1, 0, 8, 2))


def _tensors(t=2, hq=4, hkv=2, d=8, nb=6, bs=4, dtype=torch.float32):
    return (torch.randn(t, hq, d, dtype=dtype), torch.randn(t, hkv, d, dtype=dtype), torch.randn(t, hkv, d, dtype=dtype),
            torch.randn(nb, bs, hkv, d, dtype=dtype), torch.randn(nb, bs, hkv, d, dtype=dtype))


BATCH = build_unified_batch([1, 1], [4, 5], TABLE, 4)


def _call_with(**changes):
    q, k, v, kc, vc = _tensors()
    args = dict(query=q, key=k, value=v, key_cache=kc, value_cache=vc, batch=BATCH, scale=0.5)
    args.update(changes)
    return unified_attention(**args)


@pytest.mark.parametrize("changes, match", [
    (dict(query=torch.randn(3, 4, 8)), "query has 3 tokens but the batch has 2"),
    (dict(key=torch.randn(2, 2, 4)), r"key shape \(2, 2, 4\) must be \(2, 2, 8\)"),
    (dict(value=torch.randn(2, 1, 8)), r"value shape \(2, 1, 8\) must be \(2, 2, 8\)"),
    (dict(query=torch.randn(2, 3, 8)), "query heads 3 must be a multiple of kv heads 2"),
    (dict(key_cache=torch.randn(6, 8, 2, 8)), r"key_cache shape \(6, 8, 2, 8\) must be \(6, 4, 2, 8\)"),
    (dict(value_cache=torch.randn(5, 4, 2, 8)), r"value_cache shape \(5, 4, 2, 8\) must be \(6, 4, 2, 8\)"),
    (dict(key_cache=torch.randn(4, 4, 2, 8), value_cache=torch.randn(4, 4, 2, 8)),
     "block_table needs block id 4 but key_cache has 4 blocks"),
    (dict(key=torch.randn(2, 2, 8, dtype=torch.float64)), "mixed dtypes: query float32, key float64"),
    (dict(query=torch.randn(2, 4)), r"query must be a 3-D tensor, got \(2, 4\)"),
    (dict(scale=float("nan")), "scale must be a finite positive float"),
    (dict(logits_soft_cap=-1.0), "logits_soft_cap must be None or a positive float"),
    (dict(sinks=torch.zeros(2)), r"sinks must be a tensor of shape \(4,\)"),
    (dict(batch="batch"), "batch must be a UnifiedBatch"),
])
def test_bad_tensors(changes, match):
    with pytest.raises(ValueError, match=match):
        _call_with(**changes)


def test_slice_bucket_larger_than_cache():
    batch = build_unified_batch([1, 1], [4, 5], TABLE, 4, bucket=Bucket("--u", 2, 0, 9, 2))
    assert batch.unique_layout == "slice"
    with pytest.raises(ValueError, match="unique slice of 9 blocks is larger than the cache"):
        _call_with(batch=batch)


# ----------------------------------------------------------------------------- arguments of the wrong type
# A list, a numpy array where a tensor is expected, a tensor on another device, the wrong dtype:
# at every public entry point, a one-line ValueError naming the argument, never an error from deep in torch.
# A tensor on the `meta` device stands for one on another device (this machine may have no accelerator).

WRONG = {"list": lambda x: x.tolist(), "numpy": lambda x: x.numpy(), "device": lambda x: x.to("meta")}
WRONG_MATCH = {"list": "{name} must be a {dims}-D tensor, got list",
               "numpy": r"{name} must be a {dims}-D tensor, got ndarray \(torch.from_numpy makes one\)",
               "device": "{name} is on meta but query is on cpu|key is on cpu but query is on meta"}
ATTENTION_DIMS = dict(query=3, key=3, value=3, key_cache=4, value_cache=4)


def _step_args(**changes):
    q, k, v, kc, vc = _tensors()
    return {**dict(query=q, key=k, value=v, key_cache=kc, value_cache=vc, batch=BATCH, scale=0.5), **changes}


@pytest.mark.parametrize("kind", sorted(WRONG))
@pytest.mark.parametrize("name", sorted(ATTENTION_DIMS))
@pytest.mark.parametrize("entry", ["unified_attention", "attend_step"])
def test_a_wrong_type_or_device_names_the_argument(entry, name, kind):
    from vllm_gaudi_unified import attention

    args = _step_args()
    args[name] = WRONG[kind](args[name])
    with pytest.raises(ValueError, match="^(" + WRONG_MATCH[kind].format(name=name, dims=ATTENTION_DIMS[name]) + ")"):
        getattr(attention, entry)(**args)


@pytest.mark.parametrize("entry", ["unified_attention", "attend_step"])
def test_a_wrong_dtype_or_batch_names_the_argument(entry):
    from vllm_gaudi_unified import attention

    run = getattr(attention, entry)
    # attend_step checks once a call fails in torch (an integer query does; a float dtype of another width
    # torch promotes, and a server's step was checked on its first layer)
    wrong = dict(query=torch.half, value_cache=torch.half) if entry == "unified_attention" else dict(query=torch.int32)
    for name, dtype in wrong.items():
        args = _step_args()
        args[name] = args[name].to(dtype)
        with pytest.raises(ValueError, match=f"^mixed dtypes: .*{name} {str(dtype).removeprefix('torch.')}"):
            run(**args)
    with pytest.raises(ValueError, match="^query dtype must be floating point, got torch.int32"):
        run(**_step_args(**{n: x.int() for n, x in _step_args().items() if n in ATTENTION_DIMS}))
    with pytest.raises(ValueError, match="^batch must be a UnifiedBatch from build_unified_batch, got list"):
        run(**_step_args(batch=[1, 1]))
    with pytest.raises(ValueError, match="^batch is on meta but the tensors are on cpu: build the batch with device="):
        run(**_step_args(batch=BATCH.to("meta")))


@pytest.mark.parametrize("kwargs, match", [
    (dict(query_lens=None), "query_lens must be 1-D, got NoneType None"),
    (dict(query_lens=3), "query_lens must be 1-D, got int 3"),
    (dict(context_lens=torch.tensor([4, 5], device="meta")), "context_lens is a tensor on meta: the planner runs on"),
    (dict(block_table=torch.from_numpy(TABLE).to("meta")), "block_table is a tensor on meta: the planner runs on"),
    (dict(block_table=TABLE.astype(float)), "block_table must hold integers, got dtype float64"),
    (dict(block_size=torch.tensor(4)), r"block_size must be an int >= 1, got tensor\(4\)"),
    (dict(device="nope"), "device 'nope' is not a torch device"),
    (dict(device=[1]), r"device \[1\] is not a torch device"),
    (dict(device="cuda:99"), "device cuda:99: this machine has"),
    (dict(buffers=np.zeros(4)), "buffers must be StepBuffers or None, got ndarray"),
    (dict(causal="yes"), "causal must be a bool, got 'yes'"),
])
def test_build_unified_batch_names_the_argument_of_the_wrong_type(kwargs, match):
    args = {**dict(query_lens=[1, 1], context_lens=[4, 5], block_table=TABLE, block_size=4), **kwargs}
    with pytest.raises(ValueError, match="^" + match):
        build_unified_batch(**args)
    assert build_unified_batch(torch.tensor([1, 1]), torch.tensor([4, 5]), torch.from_numpy(TABLE), 4,
                               device="cpu").num_tokens == 2  # CPU tensors are the host's arrays


MLA_DIMS = dict(query=3, latent=2, latent_cache=3)


#: `checked=True` (a server's later layers) checks once a call fails in torch: a list or a numpy array always
#: does; a latent on the meta device or a float of another width may not, so those run checked here only.
MLA_CASES = [(name, kind, checked) for name in sorted(MLA_DIMS) for kind in sorted(WRONG) + ["dtype"]
             for checked in (False, True) if not checked or kind in ("list", "numpy")]


@pytest.mark.parametrize("name, kind, checked", MLA_CASES)
def test_mla_attention_names_its_own_argument(name, kind, checked):
    from vllm_gaudi_unified.mla import mla_attention

    args = dict(query=torch.randn(2, 4, 12), latent=torch.randn(2, 12), latent_cache=torch.randn(6, 4, 12))
    if kind == "dtype":
        args[name] = args[name].half()
        match = "latent dtype torch.float32 differs from the query's torch.float16" if name == "query" else \
            f"{name} dtype torch.float16 differs from the query's torch.float32"
    else:
        args[name] = WRONG[kind](args[name])
        match = WRONG_MATCH[kind].format(name=name, dims=MLA_DIMS[name]).replace("key is", "latent is")
    with pytest.raises(ValueError, match="^(" + match + ")"):
        mla_attention(*args.values(), BATCH, 0.5, 8, checked=checked)
    with pytest.raises(ValueError, match="^kv_lora_rank must be an int, got 8.0"):
        mla_attention(torch.randn(2, 4, 12), torch.randn(2, 12), torch.randn(6, 4, 12), BATCH, 0.5, 8.0)


@pytest.fixture(scope="module")
def small_plan():
    from vllm_gaudi_unified.bucket_plans import ServerSettings
    from vllm_gaudi_unified.bucket_plans.exponential import exponential_plan

    return exponential_plan(ServerSettings(block_size=16, max_num_seqs=2, max_num_batched_tokens=32,
                                           max_model_len=64, num_blocks=16))


@pytest.mark.parametrize("kwargs, match", [
    (dict(plan="plan.json"), r"plan must be a BucketPlan \(BucketPlan.load\(path\)\), got str"),
    (dict(device="nope"), "device 'nope' is not a torch device"),
    (dict(device="cuda:7"), "device cuda:7: this machine has"),
    (dict(dtype="bfloat16"), "dtype must be None or a floating-point torch.dtype, got 'bfloat16'"),
    (dict(dtype=torch.int32), "dtype must be None or a floating-point torch.dtype, got torch.int32"),
    (dict(num_qo_heads=2.0), "num_qo_heads must be None or an int >= 1, got 2.0"),
    (dict(head_dim="8"), "head_dim must be None or an int >= 1, got '8'"),
    (dict(run=3), "run must be None or a callable run"),
    (dict(buckets=[1, 2]), r"buckets must be None or a list of Bucket, got \[1, 2\]"),
    (dict(key_cache=np.zeros((16, 16, 1, 8), np.float32)), "key_cache must be a 4-D tensor, got ndarray"),
    (dict(key_cache=torch.zeros(16, 16, 1, 8).tolist()), "key_cache must be a 4-D tensor, got list"),
    (dict(key_cache=torch.zeros(16, 16, 1, 8, device="meta")), "key_cache is on meta but query is on cpu"),
    (dict(key_cache=torch.zeros(16, 16, 1, 8, dtype=torch.float16)), "mixed dtypes: .*key_cache float16"),
])
def test_warmup_names_the_argument_of_the_wrong_type(small_plan, kwargs, match):
    from vllm_gaudi_unified.warmup import warmup

    cache = torch.zeros(16, 16, 1, 8)
    args = dict(plan=small_plan, num_qo_heads=2, num_kv_heads=1, head_dim=8, dtype=torch.float32, progress=False,
                buckets=small_plan.buckets[:1], key_cache=cache, value_cache=cache.clone())
    args.update(kwargs)
    with pytest.raises(ValueError, match="^" + match):
        warmup(**args)
