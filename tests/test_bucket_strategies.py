"""Strategies: plans cover their traces and the configured maxima; bad settings fail clearly."""
import numpy as np
import pytest

from vllm_gaudi_unified.bucket_plans import ServerSettings, TraceError
from vllm_gaudi_unified.tools.evaluate import evaluate
from vllm_gaudi_unified.tools.shapes import StepShapes, shapes_of_steps, shapes_of_trace
from vllm_gaudi_unified.bucket_plans.simulator import SchedulerConfig, Simulator
from vllm_gaudi_unified.bucket_plans.workloads import workload_from
from vllm_gaudi_unified.bucket_plans.exponential import exp_values, exponential_plan
from vllm_gaudi_unified.tools.strategies import make_plan, trace_plan
from vllm_gaudi_unified.bucket_plans.trace import write_trace

SETTINGS = ServerSettings(block_size=16, max_num_seqs=16, max_num_batched_tokens=256, max_model_len=1024,
                          num_blocks=600)
SCHED = SchedulerConfig(block_size=16, max_num_seqs=16, max_num_batched_tokens=256, max_model_len=1024,
                        num_blocks=600)
WORK = workload_from("mixed", num_requests=60, prompt_median=120, prompt_max=700, output_median=40,
                     output_max=200, prefix_lens=(32, 64, 96))


def sim_shapes(seed):
    return shapes_of_steps(list(Simulator(SCHED, WORK, seed).steps()), SETTINGS, f"seed{seed}")


@pytest.fixture(scope="module")
def train():
    return StepShapes.concat([sim_shapes(1), sim_shapes(2)])


def assert_covers_all(plan, shapes, within_limits=False):
    sizes, steps = shapes.sizes, shapes.buckets()
    if within_limits:
        keep = (sizes <= SETTINGS.limits()[None, :]).all(1)
        sizes, steps = sizes[keep], [b for b, k in zip(steps, keep) if k]
    assert (plan.find_all(sizes) >= 0).all()
    for b in steps[:200]:
        assert plan.find(b).covers(b)
    assert plan.covers_limits()


def test_exp_values():
    assert exp_values(1, 100) == [1, 2, 4, 8, 16, 32, 64, 100]
    assert exp_values(1, 100, step=16) == [16, 32, 64, 100]
    assert exp_values(4, 4) == [4]
    with pytest.raises(ValueError, match="below minimum"):
        exp_values(10, 5)


def test_exponential_covers_traces_and_limits(train):
    plan = exponential_plan(SETTINGS)
    assert_covers_all(plan, train, within_limits=True)
    assert len(plan) < len(exponential_plan(SETTINGS, base=1.5))
    assert len(exponential_plan(SETTINGS, base=4)) < len(plan)


@pytest.mark.parametrize("max_graphs", [1, 4, 12])
def test_trace_plan_covers_its_traces_and_limits(train, max_graphs):
    plan = trace_plan(train, SETTINGS, max_graphs=max_graphs)
    assert len(plan) <= max_graphs
    assert_covers_all(plan, train)
    assert plan.info["expected_padding_waste"] == pytest.approx(evaluate(plan, train).padding_waste, rel=1e-3)


def test_trace_plan_more_graphs_less_waste_and_beats_exponential(train):
    held_out = sim_shapes(7)
    wastes = [evaluate(trace_plan(train, SETTINGS, max_graphs=k), held_out).padding_waste for k in (2, 6, 16)]
    assert wastes[0] > wastes[1] > wastes[2] >= 1.0
    exp = exponential_plan(SETTINGS)
    small = trace_plan(train, SETTINGS, max_graphs=max(1, len(exp) // 4))
    assert evaluate(small, held_out).padding_waste <= evaluate(exp, held_out).padding_waste


def test_trace_plan_target_waste(train):
    plan = trace_plan(train, SETTINGS, max_graphs=None, target_waste=1.3)
    assert plan.info["expected_padding_waste"] <= 1.3
    fewer = trace_plan(train, SETTINGS, max_graphs=len(plan) - 1, local_search=False)
    assert fewer.info["expected_padding_waste"] > 1.0


def test_steps_are_one_weighted_problem_not_a_lookup(train):
    """A plan from half of the steps still covers every step (the limits bucket) but pads them more."""
    half = StepShapes(train.sizes[: len(train) // 2], train.needed[: len(train) // 2], train.block_size)
    plan = trace_plan(half, SETTINGS, max_graphs=6)
    assert (plan.find_all(train.sizes) >= 0).all()


def test_bad_settings_give_clear_errors(tmp_path):
    """Each error names the field and the value."""
    with pytest.raises(ValueError, match="block_size must be an int >= 1, got 0"):
        ServerSettings(block_size=0)
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(256\) is below max_num_seqs \(512\)"):
        ServerSettings(max_num_seqs=512, max_num_batched_tokens=256)
    with pytest.raises(ValueError, match="num_blocks must be an int >= 1, got -3"):
        ServerSettings(num_blocks=-3)
    with pytest.raises(ValueError, match="max_model_len must be a positive integer, got 0"):
        ServerSettings(max_model_len=0)
    with pytest.raises(ValueError, match="block_size must be an int >= 1, got 0"):
        SchedulerConfig(block_size=0)
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(32\) is below max_num_seqs \(64\)"):
        SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=32)
    with pytest.raises(ValueError, match="maximum 5 is below minimum 10"):
        exp_values(10, 5)
    with pytest.raises(ValueError, match="max_graphs must be >= 1, got 0"):
        trace_plan(sim_shapes(3), SETTINGS, max_graphs=0)
    with pytest.raises(ValueError, match="target_waste .* got 0.5"):
        trace_plan(sim_shapes(3), SETTINGS, max_graphs=None, target_waste=0.5)
    with pytest.raises(ValueError, match="resolution must be positive, got 0"):
        trace_plan(sim_shapes(3), SETTINGS, resolution=0)
    with pytest.raises(ValueError, match="needs at least one trace"):
        make_plan("trace", SETTINGS)
    with pytest.raises(ValueError, match="unknown strategy"):
        make_plan("linear", SETTINGS)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(TraceError, match="empty.jsonl: the trace holds no scheduler step"):
        shapes_of_trace(str(empty), SETTINGS)
    with pytest.raises(TraceError, match="the trace holds no scheduler step"):
        shapes_of_steps([], SETTINGS)
    with pytest.raises(ValueError, match="no step to learn from"):
        trace_plan(StepShapes(np.zeros((0, 5), np.int64), np.zeros((0, 3), np.int64), 16), SETTINGS)
    with pytest.raises(TraceError, match="no steps"):
        StepShapes.concat([])


def test_trace_block_size_must_match(tmp_path):
    path = tmp_path / "t.jsonl"
    write_trace(str(path), list(Simulator(SCHED, WORK, 0).steps(max_steps=5)))
    with pytest.raises(TraceError, match="block_size 16 differs"):
        shapes_of_trace(str(path), ServerSettings(block_size=32, max_num_seqs=16, max_num_batched_tokens=256,
                                                  max_model_len=1024, num_blocks=600))


def test_shapes_of_trace_parallel_equals_serial(tmp_path):
    path = tmp_path / "t.jsonl.gz"
    steps = list(Simulator(SCHED, WORK, 5).steps(max_steps=120))
    write_trace(str(path), steps)
    a = shapes_of_trace(str(path), SETTINGS, jobs=1)
    b = shapes_of_trace(str(path), SETTINGS, jobs=2, chunk=25)
    c = shapes_of_steps(steps, SETTINGS)
    np.testing.assert_array_equal(a.sizes, b.sizes)
    np.testing.assert_array_equal(a.sizes, c.sizes)
    np.testing.assert_array_equal(a.needed, c.needed)


def test_gains_updates_and_best_match_the_exact_sums():
    """The greedy step's incremental gains pick what a fresh sum over every group would pick."""
    from vllm_gaudi_unified.tools.strategies import _Gains

    rng = np.random.default_rng(0)
    cost = rng.uniform(1, 100, 300)
    cov = rng.random((300, 500)) < 0.3
    w = rng.integers(1, 20, 500).astype(float)
    cur = rng.uniform(50, 200, 500)
    g = _Gains(cost, cov, w)
    g.reset(cur)
    new = cur.copy()
    changed = rng.choice(500, 40, replace=False)
    new[changed] = rng.uniform(1, 50, 40)
    approx = g.updated(new, np.sort(changed))
    exact = g.exact(new)
    np.testing.assert_allclose(approx, exact, rtol=1e-12)
    best, value = g.best(approx, new)
    assert best == int(np.argmax(exact)) and value == exact[best]


def test_trace_plan_larger_budgets_keep_improving(train):
    plans = [trace_plan(train, SETTINGS, max_graphs=k) for k in (16, 64, 256)]
    wastes = [p.info["expected_padding_waste"] for p in plans]
    assert wastes[0] >= wastes[1] >= wastes[2] >= 1.0
