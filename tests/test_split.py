"""A step beyond the gather cap runs as several calls with the same result (float64 reference)."""
from dataclasses import replace

import numpy as np
import pytest
import torch

from conftest import SMALL_TILES, Step, assert_matches, make_block_table, make_tensors
from vllm_gaudi_unified import build_unified_batch, unified_attention
from vllm_gaudi_unified.bucket import Bucket
from vllm_gaudi_unified.plan import plan_step
from vllm_gaudi_unified.plan.split import GatherCap, piece_sizes, split_plan
from vllm_gaudi_unified.reference import reference_attention

#: as bucket plans plan (a slice cannot grow past the cache), on the tiled route: the split cuts shared and unique tiles
OPTIONS = replace(SMALL_TILES, unique_layout="gather", prompt_route="tiles")
KB = SMALL_TILES.blocks_per_tile(4)  # 2 blocks per shared tile at block size 4

CASES = {
    "prefix_and_chunks": Step([1, 1, 1, 6, 9], [16, 18, 21, 16, 30], 4, prefix_groups=[([0, 1, 2, 3], 4)]),
    "decodes": Step([1] * 7, [5, 17, 1, 32, 9, 64, 12], 4),
    "long_chunk": Step([23, 1], [40, 9], 4),
}


class CappedPlan:
    """A bucket plan as `build_unified_batch` sees one: a gather cap, and `find` (here: pad by a margin)."""

    def __init__(self, cap, pad):
        self.gather_cap, self.pad, self.found = cap, pad, []

    def find(self, shape):
        self.found.append(shape)
        if not self.pad:
            return None
        return Bucket("csu", shape.query_len + 3, shape.num_shared_blocks + KB, shape.num_unique_blocks + 2,
                      shape.num_logits + 1, shape.num_causal_tiles + 1)


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("cap", [GatherCap(KB, 3), GatherCap(2 * KB, None), GatherCap(None, 5)])
@pytest.mark.parametrize("pad", [False, True])
def test_split_step_equals_reference(name, cap, pad):
    step = CASES[name]
    rng = np.random.default_rng(3)
    table, num_blocks = make_block_table(step, rng)
    q, k, v, kc, vc = make_tensors(step, table, num_blocks, torch.float64, seed=3)
    plan = plan_step(step.query_lens, step.context_lens, table, step.block_size, options=OPTIONS)
    pieces = split_plan(plan, cap)
    assert len(pieces) == len(piece_sizes(np.array([plan.shape.sizes]), cap, KB)[0])
    for p in pieces:
        assert not cap.exceeded(p.shape)
    assert sum(p.shape.num_shared_blocks for p in pieces) == plan.shape.num_shared_blocks
    assert sum(p.shape.num_unique_blocks for p in pieces) == plan.shape.num_unique_blocks
    buckets = CappedPlan(cap, pad)  # each piece padded to a larger bucket, as a plan's find would
    batch = build_unified_batch(step.query_lens, step.context_lens, table, step.block_size, options=OPTIONS,
                                bucket=buckets)
    assert len(batch.pieces) == len(pieces) - 1 and len(buckets.found) == len(pieces)
    assert [b.plan.shape for b in (batch,) + batch.pieces] == [p.shape for p in pieces]
    out = unified_attention(q, k, v, kc, vc, batch, 0.37)
    ref = reference_attention(q, k, v, kc, vc, step.query_lens, step.context_lens, table, 0.37)
    assert_matches(out, ref)


def test_split_bf16_and_sinks():
    step = CASES["prefix_and_chunks"]
    table, num_blocks = make_block_table(step, np.random.default_rng(5))
    q, k, v, kc, vc = make_tensors(step, table, num_blocks, torch.bfloat16, seed=5)
    sinks = torch.randn(step.num_qo_heads, dtype=torch.bfloat16)
    batch = build_unified_batch(step.query_lens, step.context_lens, table, 4, options=OPTIONS,
                                bucket=CappedPlan(GatherCap(KB, 3), True))
    assert batch.pieces
    out = unified_attention(q, k, v, kc, vc, batch, 0.37, sinks=sinks)
    ref = reference_attention(q, k, v, kc, vc, step.query_lens, step.context_lens, table, 0.37, sinks=sinks)
    assert_matches(out, ref)


def test_a_slice_is_cut_into_gathered_pieces():
    step = CASES["decodes"]
    table, _ = make_block_table(step, np.random.default_rng(0))
    plan = plan_step(step.query_lens, step.context_lens, table, 4, options=replace(SMALL_TILES, unique_layout="slice"))
    pieces = split_plan(plan, GatherCap(None, 4))
    assert len(pieces) > 1 and all(p.unique_blocks is not None for p in pieces)
    assert np.concatenate([p.unique_blocks for p in pieces]).tolist() == list(range(plan.shape.num_unique_blocks))


def test_piece_sizes_cut_evenly_and_keep_unsplit_steps():
    sizes = np.array([[10, 8, 7, 3, 4], [10, 40, 0, 3, 4], [1, 0, 0, 1, 0]])
    pieces, owner = piece_sizes(sizes, GatherCap(16, 5), blocks_per_tile=2)
    assert owner.tolist() == [0, 0, 1, 1, 1, 2]
    assert pieces[:2].tolist() == [[10, 8, 4, 3, 4], [10, 0, 3, 3, 0]]
    assert pieces[2:5, 1].tolist() == [14, 14, 12] and (pieces[3:5, 4] == 0).all()
    assert (pieces[5] == sizes[2]).all()


def test_gather_cap_from_memory_and_bad_values():
    cap = GatherCap.from_memory(128e9, 0.05, block_size=128, num_kv_heads=8, head_dim=128, dtype_bytes=2,
                                blocks_per_tile=4)
    assert cap.max_unique_blocks == int(0.05 * 128e9 // (2 * 128 * 8 * 128 * 2))
    assert cap.max_shared_blocks % 4 == 0 and cap.max_shared_blocks <= cap.max_unique_blocks
    with pytest.raises(ValueError, match="memory share"):
        GatherCap.from_memory(128e9, 0, 128, 8, 128, 2, 4)
    with pytest.raises(ValueError, match="max_shared_blocks"):
        GatherCap(0, 3)


def test_a_plan_keeps_its_cap_and_splits_what_is_beyond(tmp_path):
    """A real plan: no bucket beyond its cap, the cap saved with it, the limits covered by pieces, and a
    step beyond the cap split by build_unified_batch and equal to the reference."""
    from vllm_gaudi_unified.bucket import bucket_from_sizes
    from vllm_gaudi_unified.bucket_plans import BucketPlan, ServerSettings
    from vllm_gaudi_unified.bucket_plans.exponential import exponential_plan

    settings = ServerSettings(block_size=4, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256,
                              num_blocks=80, options=replace(OPTIONS, unique_layout="gather"))
    cap = GatherCap(2 * KB, 6)
    plan = exponential_plan(settings, cap=cap)
    assert plan.sizes[:, 1].max() <= 2 * KB and plan.sizes[:, 2].max() <= 6 and plan.covers_limits()
    plan.save(str(tmp_path / "p.json"))
    assert BucketPlan.load(str(tmp_path / "p.json")).gather_cap == cap
    with pytest.raises(ValueError, match="gathers more block slots"):
        BucketPlan([bucket_from_sizes([8, 4 * KB, 0, 2, 1])], settings, gather_cap=cap)
    step = CASES["prefix_and_chunks"]
    table, num_blocks = make_block_table(step, np.random.default_rng(7))
    q, k, v, kc, vc = make_tensors(step, table, num_blocks, torch.float64, seed=7)
    batch = build_unified_batch(step.query_lens, step.context_lens, table, 4, options=settings.options, bucket=plan)
    assert batch.pieces and all(not cap.exceeded(b.bucket) for b in (batch,) + batch.pieces)
    out = unified_attention(q, k, v, kc, vc, batch, 0.37)
    assert_matches(out, reference_attention(q, k, v, kc, vc, step.query_lens, step.context_lens, table, 0.37))
