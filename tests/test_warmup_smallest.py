"""Every bucket the exponential / auto plans hold gets a warmup batch of exactly its phase (no vLLM).

Also: the smallest step of each phase is the smallest one the planner makes (brute force over small
steps), and warmup skips, with one warning, the buckets of an old plan no step fits.
"""
import itertools
import logging
from dataclasses import replace

import numpy as np
import pytest

from vllm_gaudi_unified.bucket import PHASES, Bucket
from vllm_gaudi_unified.bucket_plans import ServerSettings
from vllm_gaudi_unified.bucket_plans.bucket_plan import BucketPlan
from vllm_gaudi_unified.bucket_plans.exponential import exponential_plan
from vllm_gaudi_unified.bucket_plans.settings import BUCKET_OPTIONS, PRESETS
from vllm_gaudi_unified.plan import plan_step
from vllm_gaudi_unified.plan.smallest import can_hold_a_step, smallest_steps
from vllm_gaudi_unified.warmup import step_for_bucket, warmup

SMALL = ServerSettings(block_size=16, max_num_seqs=8, max_num_batched_tokens=128, max_model_len=512, num_blocks=256)


def _assert_every_bucket_warmable(plan):
    s = plan.settings
    for b in plan.buckets:
        step = step_for_bucket(b, s.block_size, s.options, s.sliding_window)
        shape = plan_step(*step, s.block_size, sliding_window=s.sliding_window, options=s.options).shape
        assert shape.phase == b.phase and b.covers(shape), (str(b), str(shape))


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_shipped_setting_exponential_bucket_is_warmable(preset):
    plan = exponential_plan(PRESETS[preset])
    assert plan.covers_limits()
    _assert_every_bucket_warmable(plan)


@pytest.mark.parametrize("path", ["bucketing/llama8b-gaudi3_exponential.json", "bucketing/bs32-seqs64_exponential.json"])
def test_shipped_exponential_plans_are_warmable(path):
    _assert_every_bucket_warmable(BucketPlan.load(path))


@pytest.mark.parametrize("invariant,window", [(False, None), (False, 8), (False, 40), (True, None)])
def test_auto_plan_small_cpu_setting_is_warmable(invariant, window):
    """The exponential plan `vllm_plugin/auto_plan.py` falls back to for a small CPU server (its options, capped)."""
    from vllm_gaudi_unified.bucket_plans.bucket_plan import gather_cap_for
    from vllm_gaudi_unified.bucket_plans.cost import Hardware, ModelSpec

    settings = replace(SMALL, sliding_window=window, options=replace(BUCKET_OPTIONS, batch_invariant=invariant))
    spec = ModelSpec(num_layers=2, num_qo_heads=4, num_kv_heads=2, head_dim=32, dtype_bytes=4, hidden_size=128,
                     vocab_size=1000)
    cap = None if invariant else gather_cap_for(settings, spec, Hardware())
    plan = exponential_plan(settings, spec, cap=cap)
    limits = max(plan.buckets, key=lambda b: b.sizes)
    body = replace(plan, buckets=[b for b in plan.buckets if b != limits]) if invariant else plan
    _assert_every_bucket_warmable(body)
    if invariant:  # the planner makes no unique work here: only the configured-maxima bucket has it
        assert all(b.num_unique_blocks == 0 for b in body.buckets)


def _small_steps(block_size):
    """Every step of up to 3 requests, 1-3 new tokens each, 0-2 cached blocks out of 3."""
    tables = [[], [1], [2], [1, 2], [2, 1], [3, 1]]
    for n in (1, 2, 3):
        for qs in itertools.product((1, 2, 3), repeat=n):
            for ts in itertools.product(tables, repeat=n):
                width = max(1, max(len(t) for t in ts))
                yield (np.array(qs), np.array([len(t) * block_size for t in ts]),
                       np.array([t + [0] * (width - len(t)) for t in ts], dtype=np.int64))


def test_smallest_step_is_the_smallest_the_planner_makes():
    """Brute force: no small step of a phase has fewer tokens or logits than `smallest_steps` says."""
    bs = 16
    best = {}
    for q, ctx, table in _small_steps(bs):
        shape = plan_step(q, ctx, table, bs, options=BUCKET_OPTIONS).shape
        cur = best.get(shape.phase)
        best[shape.phase] = (min(shape.query_len, cur[0]), min(shape.num_logits, cur[1])) if cur else \
            (shape.query_len, shape.num_logits)
    smallest = smallest_steps(bs, BUCKET_OPTIONS)
    for phase in PHASES:
        shape = smallest[phase][1]
        assert (shape.query_len, shape.num_logits) == best[phase], phase
    assert smallest["c-u"][1].query_len == 3 and smallest["-su"][1].query_len == 2


def test_warmup_skips_buckets_no_step_fits(caplog):
    """An old plan file with `c-u:q2` and `-s-:q1`: warmup runs the rest and says how many it skipped."""
    kb = SMALL.blocks_per_tile
    dead = [Bucket("c-u", 2, 0, 1, 2, 1), Bucket("-s-", 1, kb, 0, 1, 0)]
    live = [Bucket("--u", 1, 0, 1, 1, 0), Bucket("c-u", 4, 0, 1, 2, 1)]
    assert not any(can_hold_a_step(b, 16, SMALL.options) for b in dead)
    plan = BucketPlan(dead + live, SMALL)
    with caplog.at_level(logging.WARNING, logger="vllm_gaudi_unified.warmup"):
        report = warmup(plan, mode="eager", num_qo_heads=2, num_kv_heads=1, head_dim=8, num_blocks=8, progress=False)
    assert sorted(report.buckets) == sorted(live) and sorted(report.skipped) == sorted(dead)
    warnings = [r for r in caplog.records if "skips" in r.getMessage()]
    assert len(warnings) == 1 and "2 of 4" in warnings[0].getMessage()
    with pytest.raises(ValueError, match="cannot hold"):
        step_for_bucket(dead[0], 16, SMALL.options)
