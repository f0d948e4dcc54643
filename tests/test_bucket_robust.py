"""The robust strategy: covers the whole range within the gather cap, learns from several traces,
holds at a load it never saw better than a plan learned by total work alone."""
from dataclasses import replace

import numpy as np
import pytest

from vllm_gaudi_unified.bucket import codes_of
from vllm_gaudi_unified.bucket_plans import ServerSettings
from vllm_gaudi_unified.bucket_plans.settings import BUCKET_OPTIONS
from vllm_gaudi_unified.tools.evaluate import evaluate
from vllm_gaudi_unified.tools.robust import load_scaled_shapes, robust_plan
from vllm_gaudi_unified.tools.shapes import shapes_of_steps
from vllm_gaudi_unified.bucket_plans.simulator import SchedulerConfig, Simulator
from vllm_gaudi_unified.bucket_plans.workloads import workload_from
from vllm_gaudi_unified.tools.strategies import trace_plan
from vllm_gaudi_unified.plan.split import GatherCap

#: Shared tiles of 8 rows, the default when this comparison was written. At 16 rows (the default since
#: the per-step shared rows) both plans do better on the quiet trace (worst step: robust 12.7 -> 9.3, total work alone
#: 26.8 -> 8.1), and the plan by total work alone then beats the robust one there: the property below
#: is held at the tile it was measured with.
SETTINGS = ServerSettings(block_size=16, max_num_seqs=16, max_num_batched_tokens=256, max_model_len=1024,
                          num_blocks=600, options=replace(BUCKET_OPTIONS, shared_rows=8))
SCHED = SchedulerConfig.from_settings(SETTINGS)


def sim(seed, rate, n=60):
    work = workload_from("chat", num_requests=n, arrival_rate=rate, prompt_median=80, prompt_max=600,
                         output_median=40, output_max=200, prefix_lens=(48,))
    return list(Simulator(SCHED, work, seed).steps())


@pytest.fixture(scope="module")
def busy():
    return [sim(1, 2.0), sim(2, 2.0)]


def test_covers_every_step_and_the_limits_within_the_cap(busy):
    cap = GatherCap(64, 200)
    shapes = [shapes_of_steps(s, SETTINGS, f"seed{i}") for i, s in enumerate(busy)]
    plan = robust_plan(shapes, SETTINGS, max_graphs=12, cap=cap, skeleton_ratio=8)
    assert len(plan) <= 12
    assert (plan.sizes[:, 1] <= 64).all() and (plan.sizes[:, 2] <= 200).all()
    plan.gather_cap = cap
    for s in shapes:
        e = evaluate(plan, s)
        assert e.uncovered == 0 and e.failed == 0
    lim = SETTINGS.limits()
    assert plan.find_sizes(int(lim[0]), 64, 200, int(lim[3]), int(lim[4])) >= 0
    # the skeleton: small buckets with and without causal work, well under the top one
    small = plan.sizes[plan.costs < plan.costs.max() / 4]
    assert (small[:, 4] == 0).any() and (small[:, 4] > 0).any()
    assert plan.info["skeleton_buckets"] >= 3
    assert plan.info["sources"] == ["seed0", "seed1"]


def test_load_scaled_steps_have_fewer_requests_and_planner_shapes(busy):
    base = shapes_of_steps(busy[0], SETTINGS)
    scaled = load_scaled_shapes(busy[0], SETTINGS, fractions=(0.5, 0.125), seed=3)
    assert len(scaled) == 2 and all(len(s) == len(base) for s in scaled)
    assert scaled[0].sizes[:, 3].mean() < base.sizes[:, 3].mean()
    assert scaled[1].sizes[:, 3].mean() < scaled[0].sizes[:, 3].mean()
    assert (scaled[1].sizes[:, 3] >= 1).all() and (scaled[1].sizes[:, 0] >= scaled[1].sizes[:, 3]).all()


def test_drained_steps_keep_the_requests_with_the_most_blocks_of_their_own(busy):
    from vllm_gaudi_unified.tools import shapes as sh
    from vllm_gaudi_unified.tools.robust import _own_blocks

    steps = busy[0]
    a = sh._arrays_of_steps(steps)
    own = _own_blocks(a)
    for i in range(0, len(steps), 7):  # against a count by hand: a block is its request's own when no other reads it
        rows = [list(b[:-(-(c + q) // 16)]) for b, c, q in zip(steps[i].block_ids, steps[i].context_lens,
                                                                  steps[i].query_lens)]
        uses = {}
        for r in rows:
            for b in r:
                uses[b] = uses.get(b, 0) + 1
        assert own[a.req_step == i].tolist() == [sum(uses[b] == 1 for b in r) for r in rows]
    scaled = load_scaled_shapes(steps, SETTINGS, fractions=(0.25,), seed=3, drain=True)
    assert [s.sources[0] for s in scaled] == ["steps@load0.25", "steps@drain0.25"]
    rand, drain = scaled
    n = np.bincount(a.req_step, minlength=a.num_steps)
    decodes = (rand.sizes[:, 4] == 0) & (drain.sizes[:, 4] == 0)
    assert (drain.sizes[:, 3] == np.maximum(np.round(0.25 * n), 1)).all()  # one logit per kept request (no spec)
    per_req = lambda x: x.sizes[decodes, 2].sum() / x.sizes[decodes, 3].sum()  # noqa: E731
    assert per_req(drain) > per_req(rand)  # the long requests stay


def test_holds_at_a_load_it_never_saw_better_than_total_work_alone(busy):
    shapes = [shapes_of_steps(s, SETTINGS) for s in busy]
    quiet = shapes_of_steps(sim(9, 0.15, 40), SETTINGS)
    scaled = [x for s in busy for x in load_scaled_shapes(s, SETTINGS)]
    robust = robust_plan(shapes + scaled, SETTINGS, max_graphs=10, skeleton_ratio=0,
                         source_weights=[1.0] * len(shapes) + [0.3 * len(shapes) / len(scaled)] * len(scaled))
    from vllm_gaudi_unified.tools.shapes import StepShapes

    learned = trace_plan(StepShapes.concat(shapes), SETTINGS, max_graphs=10)
    r, t = evaluate(robust, quiet), evaluate(learned, quiet)
    assert r.worst_time < t.worst_time  # (in the time model the plans are made for; not in score pairs)
    # The robust plan spends buckets on a chain per decode phase (a decode step never pays for
    # a path it does not have, which this linear model prices at nothing): its total padding is then above
    # the other plan's at this small setting (time 1.60 against 1.43, pairs 1.57 against 1.40 here, with the
    # time model's measured factors, `cost.MEASURED_FACTORS`), its worst step below.
    assert r.padding_time < 1.15 * t.padding_time
    decodes = quiet.sizes[quiet.sizes[:, 4] == 0]
    found = robust.sizes[robust.find_all(decodes)]
    assert (codes_of(found) == codes_of(decodes)).all()  # every decode step in a bucket of its own phase


def test_pair_weights_are_the_planners_work(busy):
    from vllm_gaudi_unified.bucket_plans.cost import CostModel, Hardware, ModelSpec
    from vllm_gaudi_unified.plan import plan_step

    w = CostModel(ModelSpec(), Hardware(), 16, SETTINGS.options).pair_weights
    for step in busy[0][::40]:
        p = plan_step(step.query_lens, step.context_lens, step.block_table(), 16, options=SETTINGS.options)
        assert np.dot(p.shape.sizes, w) == p.work_planned.total


def test_bad_arguments(busy):
    shapes = [shapes_of_steps(busy[0], SETTINGS)]
    for kw, match in (({"max_graphs": 0}, "max_graphs"), ({"worst": 1.0}, "worst"), ({"skeleton_ratio": 0.5}, "skeleton"),
                      ({"total_share": 2}, "total_share"), ({"source_weights": [1, 2]}, "source_weights"),
                      ({"max_graphs": 2, "skeleton_ratio": 2}, "skeleton alone")):
        with pytest.raises(ValueError, match=match):
            robust_plan(shapes, SETTINGS, **kw)
    with pytest.raises(ValueError, match="no step"):
        robust_plan([], SETTINGS)


def test_the_margin_grows_only_the_sizes_it_names():
    """A full batch of decodes sits on its request count and its shared tiles: grown by the margin they would
    take the next grid value; with `margin_sizes` only the unique blocks grow."""
    from vllm_gaudi_unified.tools.shapes import StepShapes

    step = np.array([[12, 32, 40, 12, 0]], np.int64)  # 12 decodes over one shared tile of 32 blocks (-su)
    shapes = [StepShapes(step, np.ones((1, 3), np.int64), SETTINGS.block_size)]
    fit = lambda **kw: robust_plan(shapes, SETTINGS, max_graphs=8, skeleton_ratio=0, margin=0.1, **kw)  # noqa: E731
    grown, exact = fit(), fit(margin_sizes=("unique",))
    b = exact.buckets[exact.find_sizes(*step[0])]
    assert (b.query_len, b.num_shared_blocks, b.num_logits) == (12, 32, 12) and b.num_unique_blocks >= 44
    assert exact.costs[exact.find_sizes(*step[0])] < grown.costs[grown.find_sizes(*step[0])]
    assert exact.info["margin_sizes"] == ["unique"] and "margin_sizes" not in grown.info
    with pytest.raises(ValueError, match="margin_sizes"):
        fit(margin_sizes=("rows",))


def _worst_steps(s: ServerSettings) -> list:
    """The heaviest steps `s` can schedule, as (query_lens, context_lens, block table) over one block table
    shared by all requests (a common prefix): a full-budget prompt; a long prompt and two-token prompts and
    a two-token chunk (the most causal tiles, on both sides of the own-call split); a full-budget chunk over
    the rest of the context beside decodes at the full length; short chunks at the full length."""
    budget, seqs, length, bs = s.max_num_batched_tokens, s.max_num_seqs, s.max_model_len, s.block_size
    c = s.options.causal_tile
    big = (-(-budget // c) - 1) * c + 1
    small = min(seqs - 1, (budget - big) // 2)
    chunk = budget - (seqs - 1)
    short = budget // seqs
    steps = [([budget], [0]), ([big] + [2] * small, [0] * small + [bs]),
             ([chunk] + [1] * (seqs - 1), [length - chunk] + [length - 1] * (seqs - 1)),
             ([short] * seqs, [length - short] * seqs)]
    table = 1 + np.arange(-(-length // bs))
    return [(np.array(q), np.array(ctx), np.tile(table, (len(q), 1))) for q, ctx in steps]


def test_an_invariant_plan_covers_the_heaviest_steps_its_settings_schedule(busy):
    """Batch-invariant steps count context tiles and padded causal products (`plan/invariant.py`): the
    limits, and the plan's largest bucket, must hold every step the settings allow in that mode."""
    from vllm_gaudi_unified.plan import plan_step
    from vllm_gaudi_unified.tools.robust import skeleton

    inv = replace(SETTINGS, options=replace(SETTINGS.options, batch_invariant=True, invariant_chunk=8,
                                            invariant_causal_chunk=8))
    plan = robust_plan([shapes_of_steps(s, inv, exact=True) for s in busy], inv, max_graphs=10, skeleton_ratio=8)
    assert plan.covers_limits() and (plan.sizes[:, 2] == 0).all()
    for q, ctx, table in _worst_steps(inv):
        shape = plan_step(q, ctx, table, inv.block_size, num_blocks=inv.num_blocks, options=inv.options).shape
        assert (np.array(shape.sizes) <= inv.limits()).all(), shape
        assert plan.find(shape) is not None
    # no unique path in this mode: no skeleton bucket has one (such a bucket could hold no step, and went)
    points = np.array([[64, 8, 0, 4, 8], [200, 40, 0, 16, 16]])
    chains = skeleton(points, points @ plan.cost_model.weights, inv.limits(), plan.cost_model.weights, 4.0,
                      [np.arange(0, 2000, 8)] * 5, [4, 8, 4, 2, 8])
    assert len(chains) > 1 and (chains[:, 2] == 0).all()
