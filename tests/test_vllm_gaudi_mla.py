"""MLA on the Gaudi path: vllm-gaudi's MLA layer with the unified MLA impl, on the CPU stand-in.

- b. a layer through vllm-gaudi's own `HPUMLAAttention.forward` (what its replaced
  `MultiHeadLatentAttentionWrapper` builds), with its calling convention (query `[T, H, P + R]`,
  `kv_c_normed` `[T, L]`, `k_pe` `[T, 1, R]`) and MLA cache (`(latent_cache, None, None, None)`,
  `latent_cache` `[(num_blocks + 1) * block_size, L + R]`), its weights packed by its own
  `process_weights_after_loading` from a `kv_b_proj`, against the dense expanded MLA reference
  (`reference.reference_mla`): float64 1e-6, bf16 1e-2; ragged steps, a shared prefix, a chunked
  prompt over its context, NaN in every cache slot no request may read (the padding block included);
  steps with a prompt route through vllm-gaudi's prompt branch (`forward_mha`: prompt rows expanded, the
  others latent), the others through its absorbed branch (`forward_mqa`), padded to a bucket or not;
  over vllm-gaudi's `fp8_inc` latent cache too;
- d. a whole tiny DeepSeek-V2 generation (kv_lora_rank 512 + rope 64, the CPU e2e test's model)
  through vllm-gaudi's platform, worker, runner and MLA layers with the unified runner, against vLLM's
  CPU_MLA (`test_generation_*`); with an `fp8_inc` cache against the same runner over e4m3-rounded latents.
"""
from __future__ import annotations

import os
import re
from unittest import mock

import numpy as np
import pytest
import torch

from test_vllm_gaudi import GAUDI_PLUGINS, _env, gaudi  # noqa: F401, I001 (also: the module's skips)
from conftest import Step, assert_matches, make_block_table

from vllm_gaudi_unified import PlanOptions, build_unified_batch
from vllm_gaudi_unified.paths.kv_quant import dequantize, quantize
from vllm_gaudi_unified.reference import reference_mla

pytestmark = pytest.mark.vllm

#: (L, R, P, V, H): latent, rope, per-head nope and value dims, query heads. "small" keeps fp64 fast;
#: "deepseek" is the latent of DeepSeek-V2/V3 (512 + 64) with the tiny model's per-head dims.
SHAPES = {"small": (32, 16, 16, 24, 4), "deepseek": (512, 64, 32, 32, 4)}

#: Steps (block size 16): prompts over no context and decodes in one step (ragged), decodes, a prompt
#: chunk over its cached context, a shared prefix read by decodes and chunks.
STEPS = {
    "mixed_ragged": Step([9, 1, 1, 4, 17], [0, 37, 16, 21, 0], 16),
    "decodes": Step([1] * 6, [5, 17, 1, 32, 9, 64], 16),
    "chunk_over_context": Step([24], [40], 16),
    "shared_prefix": Step([1, 1, 3, 5], [32, 35, 40, 32], 16, prefix_groups=[([0, 1, 2, 3], 2)]),
    "prompts_over_context": Step([24, 7, 2, 1], [40, 0, 19, 0], 16),
}
#: Which forms each step runs in (vllm-gaudi's layer branches on the metadata's is_prompt): "expanded" the
#: prompt route's rows (`forward_mha`, `mla_prompt_rows`), "latent" the others (`mla_attention`).
FORMS = {"mixed_ragged": {"expanded", "latent"}, "decodes": {"latent"}, "chunk_over_context": {"expanded"},
         "shared_prefix": {"latent"},  # short drafts over a shared prefix stay on the shared tiles
         "prompts_over_context": {"expanded"}}
OPTIONS = PlanOptions(causal_tile=4, shared_rows=4, shared_tile_keys=16)


class _KvBProj(torch.nn.Linear):
    """The layer's `kv_b_proj` as vLLM's linear layers call: `(output, output bias)` (the expanded form's
    `kv_b_proj(c)[0]`, as vllm-gaudi's own `forward_mha`)."""

    def forward(self, x):
        return super().forward(x), None


def _mla_layer(name: str, shape, w_uk: torch.Tensor, w_uv: torch.Tensor, dtype: torch.dtype,
               kv_cache_dtype: str = "auto"):
    """vllm-gaudi's `HPUMLAAttention` with the unified MLA backend, made as its wrapper makes it; W_UK / W_UV
    packed from a `kv_b_proj` by the layer's own `process_weights_after_loading`."""
    from vllm.config import CacheConfig, VllmConfig, set_current_vllm_config
    from vllm_gaudi.attention.oot_mla import HPUMLAAttention

    from vllm_gaudi_unified.vllm_plugin.hpu_mla import UnifiedHpuMLABackend, register_hpu_mla_backend

    L, R, P, V, H = shape
    register_hpu_mla_backend()
    # kv_b_proj: latent -> per head [nope | value], as the checkpoint stores it ([H * (P + V), L]).
    kv_b_proj = _KvBProj(L, H * (P + V), bias=False, dtype=dtype)
    kv_b_proj.quant_method = None  # unquantized, as vLLM's linear layers say it
    with torch.no_grad():
        kv_b_proj.weight.copy_(torch.cat([w_uk, w_uv.transpose(1, 2)], dim=1).reshape(H * (P + V), L))
    config = VllmConfig()
    with set_current_vllm_config(config):
        layer = HPUMLAAttention(num_heads=H, scale=(P + R) ** -0.5, qk_nope_head_dim=P, qk_rope_head_dim=R,
                                v_head_dim=V, q_lora_rank=None, kv_lora_rank=L, kv_b_proj=kv_b_proj, prefix=name,
                                attn_backend=UnifiedHpuMLABackend, cache_config=CacheConfig(cache_dtype=kv_cache_dtype))
        layer.process_weights_after_loading(dtype)
    layer.use_direct_call = True  # vllm-gaudi's platform has no opaque attention op: the layer calls its impl
    return layer, config


def _mla_case(step: Step, shape, dtype=torch.float64, seed: int = 0, name: str = "mla", pad: int = 0,
              fp8: bool = False):
    """-> (vllm-gaudi's MLA layer output [T, H, V], the dense reference, the flat cache, the slots,
    [(form, the cache it read)] of the impl's latent (`mla_attention`) and expanded (`mla_prompt_rows`)
    calls). `pad`: the step padded as the runner pads to a bucket (`_padded_bucket`): `pad` more rows of
    random inputs written to the padding block, the output's first T rows returned. `fp8`: vllm-gaudi's
    `fp8_inc` latent cache (e4m3), the reference over its dequantized bytes and the new latents as stored."""
    from vllm.forward_context import set_forward_context

    from vllm_gaudi_unified.vllm_plugin import hpu_mla
    from vllm_gaudi_unified.vllm_plugin.hpu_backend import UnifiedHpuMetadata

    L, R, P, V, H = shape
    rng = np.random.default_rng(seed)
    table, num_blocks = make_block_table(step, rng)
    table = np.where(table < 0, 0, table)  # vLLM's block tables hold 0 past a request's blocks
    g = torch.Generator().manual_seed(seed)
    rand = lambda *s, scale=1.0: (scale * torch.randn(*s, generator=g, dtype=torch.float64)).to(dtype)
    t, bs = sum(step.query_lens), step.block_size
    q = rand(t, H, P + R)
    kv_c, k_pe = rand(t, L), rand(t, 1, R)
    w_uk, w_uv = rand(H, P, L, scale=L ** -0.5), rand(H, L, V, scale=L ** -0.5)
    blocks = rand(num_blocks, bs, L + R)
    readable = torch.zeros(num_blocks, bs, dtype=torch.bool)
    for r, c in enumerate(step.context_lens):
        for pos in range(c):
            readable[table[r, pos // bs], pos % bs] = True
    blocks[~readable] = float("nan")
    # vllm-gaudi's MLA cache: num_blocks + 1 blocks flattened to slots, the extra one NaN too.
    cache = torch.full(((num_blocks + 1) * bs, L + R), float("nan"), dtype=dtype)
    cache[:num_blocks * bs] = blocks.reshape(-1, L + R)
    if fp8:  # (scale 1: vllm-gaudi's fp8_inc without INC; NaN slots stay NaN bytes)
        cache = quantize(cache, torch.float8_e4m3fn)
        blocks = dequantize(cache[:num_blocks * bs], None).view(num_blocks, bs, L + R)
    layer, config = _mla_layer(name, shape, w_uk, w_uv, dtype, "fp8_inc" if fp8 else "auto")
    layer.kv_cache = (cache, None, None, None)  # what vllm-gaudi's runner binds to an MLA layer
    batch = build_unified_batch(step.query_lens, step.context_lens, table, bs, options=OPTIONS)
    req = np.repeat(np.arange(len(step.query_lens)), step.query_lens)
    starts = np.cumsum(step.query_lens) - step.query_lens
    pos = np.asarray(step.context_lens)[req] + np.arange(len(req)) - starts[req]
    slots = torch.from_numpy(table[req, pos // bs] * bs + pos % bs)
    q_in, kv_c_in, k_pe_in = q, kv_c, k_pe
    if pad:
        bucket = _padded_bucket(batch.bucket, pad)
        batch = build_unified_batch(step.query_lens, step.context_lens, table, bs, options=OPTIONS, bucket=bucket)
        assert batch.bucket == bucket
        slots = torch.cat([slots, torch.full((pad,), num_blocks * bs)])  # vllm-gaudi's _PAD_SLOT_ID
        q_in, kv_c_in, k_pe_in = (torch.cat([x, rand(pad, *x.shape[1:])]) for x in (q, kv_c, k_pe))
    attended = []

    def spy(form, run):
        def call(q, latent, latent_cache, *args, **kwargs):
            attended.append((form, latent_cache))
            return run(q, latent, latent_cache, *args, **kwargs)
        return call

    with mock.patch.object(hpu_mla, "mla_attention", spy("latent", hpu_mla.mla_attention)), \
            mock.patch.object(hpu_mla, "mla_prompt_rows", spy("expanded", hpu_mla.mla_prompt_rows)), \
            set_forward_context({layer.layer_name: UnifiedHpuMetadata(batch=batch, slot_mapping=slots)}, config):
        out = layer(q_in, kv_c_in, k_pe_in, output_shape=torch.Size((t + pad, H * V)))
    assert out.shape == (t + pad, H * V)
    out = out[:t]
    latent = torch.cat([kv_c, k_pe.flatten(1)], dim=-1)
    if fp8:  # as stored: what later steps read, and what the step's own tokens attend to
        latent = dequantize(quantize(latent, torch.float8_e4m3fn), None)
    ref = reference_mla(q[..., :P], q[..., P:], latent, blocks, w_uk, w_uv, step.query_lens, step.context_lens,
                        table, layer.scale, L)
    return out.reshape(t, H, V), ref, cache, slots, attended


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("name", sorted(STEPS))
def test_mla_layer_through_vllm_gaudi_forward(gaudi, name, shape):
    """fp64: the layer's output equals the expanded reference to 1e-6, in the forms the step's bucket picks
    (prompt route expanded through `forward_mha`, the other rows latent: absorbed query, latent attention,
    W_UV); each form read vllm-gaudi's cache tensor itself (a view, no copy), into which the layer wrote the
    step's latents."""
    out, ref, cache, slots, attended = _mla_case(STEPS[name], SHAPES[shape], name=f"b.mla.{name}.{shape}")
    assert_matches(out, ref)
    print(name, shape, "max |err| fp64", (out - ref).abs().max().item())
    assert [form for form, _ in attended] == sorted(FORMS[name], reverse=True)  # latent rows first
    for _, read in attended:
        assert read.data_ptr() == cache.data_ptr() and read.shape == (cache.shape[0] // 16, 16, cache.shape[1])
    assert torch.isfinite(cache[slots]).all()


def _padded_bucket(bucket, pad: int, prompts: bool = True):
    """`bucket` with `pad` more rows, unique blocks and a logit row, and (`prompts`) a prompt route's shape
    larger than the step's (what a bucket plan's bucket or prompt graph adds: fully masked work)."""
    from dataclasses import replace

    from vllm_gaudi_unified.bucket import phase_of, pow2

    unique = bucket.num_unique_blocks + 1  # (a unique slice may not outgrow the cache)
    bucket = replace(bucket, phase=phase_of(bucket.num_causal_tiles, bucket.num_shared_blocks, unique),
                     query_len=bucket.query_len + pad, num_unique_blocks=unique, num_logits=bucket.num_logits + 1)
    if not prompts:
        return bucket
    return replace(bucket, num_prompts=pow2(bucket.num_prompts + 1), prompt_len=pow2(bucket.prompt_len + 1),
                   prompt_blocks=pow2(bucket.prompt_blocks + 1))


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("name", ["mixed_ragged", "prompts_over_context", "decodes"])
def test_mla_layer_padded_to_a_bucket(gaudi, name, shape):
    """fp64, the step padded to a larger bucket (rows, unique blocks, a prompt route's shape), as the
    runner pads to a bucket plan's: results within 1e-6. The branch is the bucket's (is_prompt): a step of
    decodes in a bucket with a prompt shape takes vllm-gaudi's prompt branch too, its rows all latent there
    and the expanded call over padding prompts only (a bucket plan pads it to no such bucket: its prompt
    graphs take steps with prompts only)."""
    out, ref, cache, slots, attended = _mla_case(STEPS[name], SHAPES[shape], name=f"b.mla.pad.{name}.{shape}",
                                                 pad=5)
    assert_matches(out, ref)
    assert {form for form, _ in attended} == FORMS[name] | {"expanded"}
    assert all(read.data_ptr() == cache.data_ptr() for _, read in attended)
    print(name, shape, "padded: max |err| fp64", (out - ref).abs().max().item())


def test_is_prompt_follows_the_bucket(gaudi):
    """The metadata's is_prompt (vllm-gaudi's MLA branch) is the bucket's: True exactly when it has a prompt
    route in its final form; the same for a step padded to a larger bucket; False with fused kernels off (the
    prompt route's partial form, merged with the other paths) and in batch-invariant mode (no prompt route)."""
    from dataclasses import replace

    from vllm_gaudi_unified.vllm_plugin.hpu_backend import UnifiedHpuMetadata

    for name, step in STEPS.items():
        table, _ = make_block_table(step, np.random.default_rng(0))
        table = np.where(table < 0, 0, table)

        def is_prompt(options, bucket=None):
            batch = build_unified_batch(step.query_lens, step.context_lens, table, step.block_size, options=options,
                                        bucket=bucket)
            return UnifiedHpuMetadata(batch=batch, slot_mapping=torch.zeros(0)).is_prompt, batch.bucket

        got, bucket = is_prompt(OPTIONS)
        assert got == ("expanded" in FORMS[name]) == (bucket.num_prompts > 0), name
        # The bucket decides: padded to one with a prompt shape, a step takes the prompt branch (a step of
        # decodes too: its rows all latent there, test_mla_layer_padded_to_a_bucket); without one, not.
        assert is_prompt(OPTIONS, _padded_bucket(bucket, 3))[0], name
        assert is_prompt(OPTIONS, _padded_bucket(bucket, 3, prompts=False))[0] == got, name
        assert not is_prompt(replace(OPTIONS, fused_kernels=False))[0], name
        assert not is_prompt(replace(OPTIONS, batch_invariant=True))[0], name


@pytest.mark.parametrize("name", ["mixed_ragged", "chunk_over_context", "shared_prefix", "prompts_over_context"])
def test_mla_layer_bf16(gaudi, name):
    out, ref, _, _, attended = _mla_case(STEPS[name], SHAPES["deepseek"], dtype=torch.bfloat16,
                                         name=f"b.mla16.{name}")
    assert out.dtype == torch.bfloat16
    assert_matches(out, ref)
    assert {form for form, _ in attended} == FORMS[name]
    print(name, "max |err| bf16", (out.double() - ref).abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=["fp64", "bf16"])
@pytest.mark.parametrize("name", sorted(STEPS))
def test_mla_layer_fp8_latent_cache(gaudi, name, dtype):
    """vllm-gaudi's `fp8_inc` latent cache (e4m3, scale 1): the layer writes the step's latents rounded to
    nearest (the HPU cast's way) and every form reads the cache's bytes, dequantized as gathered: against the
    reference over the dequantized cache, float64 1e-6 and bf16 1e-2, padded to a bucket too; NaN bytes in
    every unreadable slot."""
    for pad in (0, 5):
        out, ref, cache, slots, attended = _mla_case(STEPS[name], SHAPES["deepseek"], dtype=dtype, pad=pad, fp8=True,
                                                     name=f"b.mla.fp8.{name}.{dtype}.{pad}")
        assert cache.dtype == torch.float8_e4m3fn and out.dtype == dtype
        assert_matches(out, ref)
        assert {form for form, _ in attended} == FORMS[name] | ({"expanded"} if pad else set())
        assert all(read.data_ptr() == cache.data_ptr() for _, read in attended)
        written = dequantize(cache[slots], None)
        assert torch.isfinite(written).all()
        print(name, dtype, pad, "fp8 latents: max |err|", (out.double() - ref).abs().max().item())


def test_gaudi_platform_selects_the_mla_backend(gaudi):
    """vllm-gaudi's platform with unified attention picks the Gaudi MLA backend for MLA layers (it refused them
    before: "MLA not supported" from the decoder backend); what that backend does not serve fails at selection."""
    from vllm.v1.attention.selector import AttentionSelectorConfig

    from vllm_gaudi_unified.vllm_plugin.hpu_platform import UnifiedHpuPlatform

    def select(**kw):
        base = dict(head_size=576, dtype=torch.bfloat16, kv_cache_dtype="auto", block_size=128, use_mla=True)
        return UnifiedHpuPlatform.get_attn_backend_cls(None, AttentionSelectorConfig(**{**base, **kw}))

    assert select() == "vllm_gaudi_unified.vllm_plugin.hpu_mla.UnifiedHpuMLABackend"
    assert select(kv_cache_dtype="bfloat16", block_size=16, dtype=torch.float32)
    assert select(kv_cache_dtype="fp8_inc")  # e4m3 latents (test_mla_layer_fp8_latent_cache)
    for kw, reason in ((dict(kv_cache_dtype="fp8_e5m2"), "kv_cache_dtype not supported"),
                       (dict(head_size=20), "head_size not supported"), (dict(block_size=8), "block_size not supported"),
                       (dict(use_sparse=True), "sparse not supported"), (dict(has_sink=True), "sinks not supported")):
        with pytest.raises(ValueError, match=reason):
            select(**kw)


def test_sparse_mla_models_are_refused(gaudi):
    """DeepSeek-V3.2-style models (DSA: `index_topk` in the config) are refused at start-up, not run as dense MLA."""
    from types import SimpleNamespace

    from vllm_gaudi_unified.vllm_plugin.hpu_platform import refuse_unserved_models

    def config(**hf):
        model = SimpleNamespace(is_multimodal_model=False, use_mla=True, hf_text_config=SimpleNamespace(**hf))
        return SimpleNamespace(model_config=model, lora_config=None)

    refuse_unserved_models(config())
    with pytest.raises(NotImplementedError, match="sparse \\(DSA\\) MLA layers \\(index_topk 2048"):
        refuse_unserved_models(config(index_topk=2048))


def test_mla_impl_refusals(gaudi):
    """What the Gaudi MLA impl does not serve stops at construction or names the metadata it was given."""
    from vllm_gaudi_unified.vllm_plugin.hpu_backend import UnifiedHpuMetadata
    from vllm_gaudi_unified.vllm_plugin.hpu_mla import UnifiedHpuMLAImpl

    shape = SHAPES["small"]
    layer, _ = _mla_layer("b.mla.refuse", shape, torch.zeros(4, 16, 32), torch.zeros(4, 32, 24), torch.float32)
    impl = layer.impl
    assert isinstance(impl, UnifiedHpuMLAImpl)
    with pytest.raises(TypeError, match="HPUAttentionMetadata.*unified model runner"):
        from vllm_gaudi.attention.backends.hpu_attn import HPUAttentionMetadata
        md = HPUAttentionMetadata.__new__(HPUAttentionMetadata)
        impl.forward_mqa(torch.zeros(2, 4, 32), torch.zeros(2, 4, 16), (torch.zeros(32, 48),), md)
    with pytest.raises(TypeError, match="forward_mha: attn_metadata of type HPUAttentionMetadata"):
        impl.forward_mha(torch.zeros(2, 4, 32), torch.zeros(2, 48), (torch.zeros(32, 48),), md)
    # A step with prompts and decodes outside a forward context: its decodes need the layer's W_UK_T.
    step = STEPS["mixed_ragged"]
    table, _ = make_block_table(step, np.random.default_rng(0))
    batch = build_unified_batch(step.query_lens, step.context_lens, np.where(table < 0, 0, table), 16, options=OPTIONS)
    md = UnifiedHpuMetadata(batch=batch, slot_mapping=torch.zeros(batch.bucket.query_len, dtype=torch.int64))
    t = batch.bucket.query_len
    with pytest.raises(RuntimeError, match="no MLA layer with this impl and its W_UK_T in the forward context"):
        impl.forward_mha(torch.zeros(t, 4, 32), torch.zeros(t, 48), (torch.zeros(64 * 16, 48),), md)
    kwargs = dict(num_heads=4, head_size=48, scale=1.0, num_kv_heads=1, alibi_slopes=None, sliding_window=None,
                  logits_soft_cap=None, attn_type="decoder", kv_sharing_target_layer_name=None, q_lora_rank=None,
                  kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, qk_head_dim=32, v_head_dim=24,
                  kv_b_proj=layer.kv_b_proj)
    with pytest.raises(NotImplementedError, match="kv_cache_dtype 'fp8_e5m2'"):  # (fp8_inc: e4m3, served)
        UnifiedHpuMLAImpl(kv_cache_dtype="fp8_e5m2", **kwargs)
    with pytest.raises(NotImplementedError, match="attention sinks in an MLA layer"):
        UnifiedHpuMLAImpl(kv_cache_dtype="auto", sinks=torch.zeros(4), **kwargs)


# ---------------------------------------------------------------------------------------- d. generation

LOGPROB_ATOL = 1e-4  # the CPU e2e tests' bound (tests/test_vllm_e2e.py explains it)


def _mla_engine(model: str, out: str, gaudi: bool, extra: tuple = (), **env) -> tuple[dict, str]:
    """`vllm_model_helpers.py mla` (the CPU MLA e2e scenario; `extra`: more of its arguments) in a subprocess;
    through vllm-gaudi's platform, worker, runner and MLA layers on the stand-in with the unified runner when
    `gaudi`."""
    import vllm_model_helpers as M

    if not gaudi:
        return M.run_engine("mla", model, out, *extra)
    path = os.pathsep.join([os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.environ.get("PYTHONPATH", "")])
    return M.run_engine("mla", model, out, "--gaudi-standin", *extra, VLLM_PLUGINS=GAUDI_PLUGINS,
                        VLLM_GAUDI_UNIFIED="1", PYTHONPATH=path, **env)


@pytest.fixture(scope="module")
def mla_generations(tmp_path_factory):
    from dataclasses import replace

    import vllm_model_helpers as M
    from vllm_gaudi_unified.bucket_plans.exponential import exponential_plan
    from vllm_gaudi_unified.bucket_plans.prompt_graphs import learn_prompt_graphs
    from vllm_gaudi_unified.bucket_plans.settings import ServerSettings
    from vllm_gaudi_unified.bucket_plans.trace import read_trace
    import vllm_helpers as H

    root = tmp_path_factory.mktemp("d_mla")
    model = M.make_tiny_deepseek(str(root / "ds"))
    trace = str(root / "trace.jsonl")

    def unified_then_buckets() -> dict:
        runs = {"unified": _mla_engine(model, str(root / "unified.json"), gaudi=True,
                                       VLLM_GAUDI_UNIFIED_RECORD_TRACE=trace, VLLM_LOGGING_LEVEL="DEBUG")}
        # The scenario's server settings (vllm_model_helpers.run_mla: blocks of 16, 8 sequences, 64-token budget),
        # with the prompt graphs of the unpadded run's steps (as `buckets generate --trace` learns them): the
        # prompt steps padded to one run expanded, the others on the tiled route, latent.
        plan = exponential_plan(ServerSettings(block_size=16, max_num_seqs=8, max_num_batched_tokens=64,
                                               max_model_len=H.MAX_MODEL_LEN, num_blocks=256), base=8.0)
        graphs, _ = learn_prompt_graphs(plan, read_trace(trace).steps, max_graphs=8)
        assert graphs, "the unpadded run recorded no step with prompts"
        plan = replace(plan, prompt_graphs=graphs)
        plan.save(str(root / "plan.json"))
        runs["unified_buckets"] = _mla_engine(
            model, str(root / "buckets.json"), gaudi=True, VLLM_GAUDI_UNIFIED_BUCKETS=str(root / "plan.json"),
            VLLM_LOGGING_LEVEL="DEBUG") + (len(plan.buckets) + len(plan.prompt_graphs),)
        return runs

    runs, ref = H.concurrently(unified_then_buckets, lambda: _mla_engine(model, str(root / "ref.json"), gaudi=False))
    return dict(runs, ref=ref)


@pytest.mark.slow
@pytest.mark.parametrize("run", ["unified", "unified_buckets"])
def test_deepseek_v2_generation_through_the_unified_runner(mla_generations, run):
    """The tiny DeepSeek-V2 of the CPU MLA e2e test (kv_lora_rank 512 + rope 64) through vllm-gaudi's platform,
    worker, model runner, MLA layers (`HPUMLAAttention`) and sampling with the unified runner and MLA impl, on
    the CPU stand-in, chunked prefill and prefix caching on (64-token budget): the same tokens as vLLM's CPU_MLA
    (which runs without either), logprobs within 1e-4. Steps with prompts take vllm-gaudi's prompt branch, the
    impl's `forward_mha`: prompt rows expanded, the others latent. With a bucket plan (prompt graphs included)
    every bucket runs through the whole model at start-up, then every step is padded to its bucket: steps in a
    prompt graph expanded, the others latent. n=2: vllm-gaudi's runner draws in its own batch order without a
    per-request seed off-HPU (vllm_model_helpers.run_mla), so its first token's top logprobs are compared."""
    ref, ref_log = mla_generations["ref"]
    got, log = mla_generations[run][:2]
    assert "Using CPU_MLA backend" in ref_log
    assert "Using the unified attention backend GAUDI_UNIFIED_HPU_MLA" in log
    assert "vllm-gaudi's model runner plans every step as one unified batch (backend GAUDI_UNIFIED_HPU_MLA)" in log
    assert got["chunked_prefill"] and got["prefix_caching"] and got["block_size"] == 16
    assert "unified MLA on Gaudi: prompt rows in the expanded form" in log  # forward_mha ran
    # Each step's bucket: with a prompt shape (":p") it ran in vllm-gaudi's prompt branch (is_prompt), expanded.
    buckets = re.findall(r"unified attention step: phase \S+, bucket (\S+), step shape", log)
    expanded = sum(":p" in b for b in buckets)
    assert expanded, "no step ran in the expanded form"
    assert expanded < len(buckets), "no step ran latent alone (decodes)"
    if run == "unified_buckets":
        assert f"warmed {mla_generations[run][2]} buckets through the model" in log
    print(run, f"{expanded} of {len(buckets)} steps expanded (prompt route), warmed", mla_generations[run][2:])
    import vllm_helpers as H

    random_cases = {"parallel_n2"}
    report = H.compare_results(got, ref)
    assert len(report) == 9
    worst = 0.0
    for case, r in report.items():
        if case in random_cases:
            for a, b in zip(got["results"][case]["samples"], ref["results"][case]["samples"]):
                first_a, first_b = a["logprobs"][0], b["logprobs"][0]
                common = first_a.keys() & first_b.keys()
                assert len(common) >= 2, (case, first_a, first_b)
                worst = max(worst, max(abs(first_a[t] - first_b[t]) for t in common))
            continue
        assert r["tokens_identical"], (case, r)
        worst = max(worst, r["max_abs_logprob_diff"])
    assert worst <= LOGPROB_ATOL, worst
    print(run, "max |dlogprob| vs vLLM CPU_MLA", worst)


@pytest.mark.slow
def test_deepseek_v2_fp8_latent_cache_through_the_unified_runner(mla_generations, tmp_path):
    """`kv_cache_dtype="fp8_inc"` (vllm-gaudi's e4m3 cache): the latents are stored rounded to nearest (scale 1)
    and every form reads the bytes back. Its exact reference is the same runner over a float32 cache whose new
    latents vllm-gaudi's MLA layer rounds to e4m3 first (`vllm_model_helpers._e4m3_latents`): the same tokens,
    the same logprobs (1e-4; measured equal). Against the unquantized run the tokens change (the rounding is
    real: e4m3 keeps 3 mantissa bits of a random tiny model's latents)."""
    import vllm_helpers as H
    import vllm_model_helpers as M

    model = M.make_tiny_deepseek(str(tmp_path / "ds"))
    (fp8, log), (rounded, _) = H.concurrently(
        lambda: _mla_engine(model, str(tmp_path / "fp8.json"), gaudi=True, extra=["--kv-cache-dtype", "fp8_inc"]),
        lambda: _mla_engine(model, str(tmp_path / "rounded.json"), gaudi=True, extra=["--e4m3-latents"]))
    assert "Using the unified attention backend GAUDI_UNIFIED_HPU_MLA" in log
    assert "unified MLA on Gaudi: fp8 latent cache (torch.float8_e4m3fn, scale 1.0)" in log
    assert "unified MLA on Gaudi: prompt rows in the expanded form" in log  # forward_mha ran, over fp8 context
    worst = 0.0
    for case, r in H.compare_results(fp8, rounded).items():
        assert r["tokens_identical"], (case, r)
        worst = max(worst, r["max_abs_logprob_diff"])
    assert worst <= LOGPROB_ATOL, worst
    unquantized = H.compare_results(fp8, mla_generations["unified"][0])
    assert not all(r["tokens_identical"] for r in unquantized.values())
    print("fp8 latents: max |dlogprob| vs e4m3-rounded float32 latents", worst, "; cases whose tokens the rounding "
          "changed", sum(not r["tokens_identical"] for r in unquantized.values()), "of", len(unquantized))
