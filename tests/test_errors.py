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
