"""Honest figures: every step counted (misses by the plan's policy), both measures, worst and p99."""
import numpy as np
import pytest

from vllm_gaudi_unified.bucket_plans import BucketPlan, ServerSettings
from vllm_gaudi_unified.tools.evaluate import evaluate, pad_steps
from vllm_gaudi_unified.bucket import bucket_from_sizes
from vllm_gaudi_unified.tools.shapes import StepShapes
from vllm_gaudi_unified.plan.split import GatherCap

SETTINGS = ServerSettings(block_size=16, max_num_seqs=16, max_num_batched_tokens=256, max_model_len=1024,
                          num_blocks=600)
KB = SETTINGS.blocks_per_tile


def plan_of(rows, policy="error"):
    return BucketPlan([bucket_from_sizes(r) for r in rows], SETTINGS, miss_policy=policy)


STEPS = np.array([[1, 0, 3, 1, 0], [4, 0, 10, 4, 0], [40, 2 * KB, 30, 4, 3], [200, 0, 100, 16, 9]])


def shapes(sizes=STEPS):
    needed = np.ones((len(sizes), 3), np.int64)
    return StepShapes(np.asarray(sizes), needed, SETTINGS.block_size, ("t",))


@pytest.mark.parametrize("policy", ["error", "unbucketed", "largest"])
def test_misses_are_counted_by_the_miss_policy(policy):
    plan = plan_of([[4, 0, 16, 4, 0], [64, 4 * KB, 64, 8, 4]], policy)
    e = evaluate(plan, shapes())
    assert e.steps == 4 and e.uncovered == 1  # the last step is beyond every bucket
    p = pad_steps(plan, STEPS)
    wt = plan.cost_model.weights
    # the missed step runs at its own shape (largest cannot cover it either)
    assert p.padded_time[3] == pytest.approx(STEPS[3] @ wt)
    assert e.failed == (0 if policy == "unbucketed" else 1)
    expected = (plan.sizes[plan.find_all(STEPS[:3])] @ wt).sum() + STEPS[3] @ wt
    assert e.padding_time == pytest.approx(expected / (STEPS @ wt).sum())


def test_both_measures_worst_and_p99():
    plan = plan_of([[4, 0, 16, 4, 0], [256, 8 * KB, 200, 16, 10]])
    e = evaluate(plan, shapes())
    wt, wp = plan.cost_model.weights, plan.cost_model.pair_weights
    padded = plan.sizes[plan.find_all(STEPS)]
    assert e.padding_pairs == pytest.approx((padded @ wp).sum() / (STEPS @ wp).sum())
    rt, rp = (padded @ wt) / (STEPS @ wt), (padded @ wp) / (STEPS @ wp)
    assert e.worst_time == pytest.approx(rt.max()) and e.worst_pairs == pytest.approx(rp.max())
    assert e.p99_time == pytest.approx(np.percentile(rt, 99))
    assert "ran as" in e.worst_step and e.uncovered == 0
    assert "score pairs" in e.table()


def test_steps_beyond_the_cap_are_split_into_calls():
    plan = plan_of([[256, 2 * KB, 20, 16, 10], [256, 0, 20, 16, 0], [256, 2 * KB, 0, 16, 0]])
    plan.gather_cap = GatherCap(2 * KB, 20)
    big = np.array([[100, 6 * KB, 50, 8, 4]])
    e = evaluate(plan, shapes(big))
    assert e.calls == 3 and e.uncovered == 0
    p = pad_steps(plan, big)
    assert p.call_sizes[:, 1].sum() == 6 * KB and p.call_sizes[:, 2].sum() == 50


def test_invariant_chunks_count_as_padding():
    from dataclasses import replace

    inv = replace(SETTINGS, options=replace(SETTINGS.options, batch_invariant=True, invariant_chunk=8,
                                            invariant_causal_chunk=4))
    plan = BucketPlan([bucket_from_sizes([64, 10, 0, 8, 5])], inv)
    p = pad_steps(plan, np.array([[10, 3, 0, 2, 1]]))
    assert p.padded_sizes.tolist() == [[64, 16, 0, 8, 8]]  # units and causal tiles run in whole products
