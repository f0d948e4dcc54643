"""Bucketing with speculative decoding: the exponential plan's speculative-decode buckets, the bound on
their causal tiles, and the simulator's draft tokens with rejections and rollback."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from vllm_gaudi_unified import plan_step
from vllm_gaudi_unified.bucket_plans.bucket_plan import BucketPlan
from vllm_gaudi_unified.bucket_plans.exponential import (
    exponential_plan,
    max_causal_tiles,
    speculative_causal_tiles,
)
from vllm_gaudi_unified.bucket_plans.settings import ServerSettings
from vllm_gaudi_unified.bucket_plans.simulator import SchedulerConfig, Simulator
from vllm_gaudi_unified.bucket_plans.workloads import workload_from

SETTINGS = dict(block_size=32, max_num_seqs=64, max_num_batched_tokens=1024, max_model_len=2048, num_blocks=3000)


def _spec_decode_step(num_requests: int, k: int, rng: np.random.Generator, block_size: int = 32):
    """Decodes with 1..1+k tokens each (drafts proposed or not) over random contexts, blocks from a shuffled pool."""
    q = rng.integers(1, k + 2, num_requests)
    c = rng.integers(1, 1500, num_requests)
    need = -(-(q + c) // block_size)
    pool = rng.permutation(np.arange(1, 3000))
    table = np.full((num_requests, need.max()), -1)
    start = 0
    for r, n in enumerate(need):
        table[r, :n] = pool[start:start + n]
        start += n
    return q, c, table


@pytest.mark.parametrize("k", [1, 2, 4, 7])
def test_speculative_causal_tile_bound_holds_for_the_planner(k):
    """The bound the plan's speculative buckets use: a step of decodes with drafts never lists more tiles."""
    rng = np.random.default_rng(k)
    opts = ServerSettings(**SETTINGS).options
    for _ in range(20):
        q, c, table = _spec_decode_step(int(rng.integers(1, 65)), k, rng)
        shape = plan_step(q, c, table, 32, options=opts).shape
        assert shape.num_causal_tiles <= speculative_causal_tiles(shape.query_len, opts.causal_tile, k)


def test_exponential_plan_gives_drafts_small_causal_buckets():
    """With num_speculative_tokens the plan holds buckets whose causal work is the diagonal only; a step of
    64 speculative decodes pads to one of them, far below the prefill bucket's triangle."""
    rng = np.random.default_rng(0)
    q, c, table = _spec_decode_step(64, 3, rng)
    q[:] = 4
    plain = exponential_plan(ServerSettings(**SETTINGS))
    spec = exponential_plan(ServerSettings(**SETTINGS, num_speculative_tokens=3))
    assert len(spec) > len(plain) and spec.info["num_speculative_tokens"] == 3
    shape = plan_step(q, c, table, 32, options=spec.settings.options).shape
    assert shape.query_len == 256 and shape.phase[0] == "c"
    got_plain, got_spec = plain.find(shape), spec.find(shape)
    assert got_plain.num_causal_tiles == max_causal_tiles(got_plain.query_len, 64)  # the full triangle
    assert got_spec.num_causal_tiles <= 2 * -(-got_spec.query_len // 64) - 1
    model = spec.cost_model
    assert model.cost(got_spec.sizes) < model.cost(got_plain.sizes)
    again = BucketPlan.from_dict(json.loads(json.dumps(spec.to_dict())))
    assert again.settings.num_speculative_tokens == 3
    assert ServerSettings.from_dict(ServerSettings(**SETTINGS).to_dict()).num_speculative_tokens == 0


@pytest.mark.parametrize("bad", [-1, 1.5, True])
def test_bad_num_speculative_tokens_is_an_error(bad):
    with pytest.raises(ValueError, match="num_speculative_tokens must be an integer >= 0"):
        ServerSettings(**SETTINGS, num_speculative_tokens=bad)
    with pytest.raises(ValueError, match="num_speculative_tokens must be an integer >= 0"):
        SchedulerConfig(**{k: v for k, v in SETTINGS.items()}, num_speculative_tokens=bad)


def test_simulator_schedules_drafts_and_rolls_back_rejections():
    """Decodes come with their k drafts; a request's context grows by 1 + accepted drafts (between 1 and
    its query), and over many drafts the accepted share is the configured acceptance."""
    k, p = 3, 0.6
    sched = SchedulerConfig(**SETTINGS, num_speculative_tokens=k, draft_acceptance=p)
    sim = Simulator(sched, workload_from("chat", num_requests=24), seed=2)
    steps = list(sim.steps())
    assert len(sim.finished) == 24
    grow, drafts = [], 0
    for a, b in zip(steps, steps[1:]):
        # A request is found again by its last block (the one it is writing: owned by it alone).
        for ids, q, ctx in zip(a.block_ids, a.query_lens, a.context_lens):
            i = len(ids) - 1
            same = [c for ids_b, c in zip(b.block_ids, b.context_lens) if len(ids_b) > i and ids_b[i] == ids[i]]
            if q == 1 + k and len(same) == 1:
                grow.append(same[0] - ctx)
                drafts += k
    grow = np.array(grow)
    assert grow.size > 200
    assert grow.min() >= 1 and grow.max() <= 1 + k and (grow < 1 + k).any(), "no rejected draft rolled back"
    expected = sum(p ** j for j in range(1, k + 1)) / k  # accepted share of a chain of k drafts
    assert abs((grow - 1).sum() / drafts - expected) < 0.05
    plain = list(Simulator(SchedulerConfig(**SETTINGS), workload_from("chat", num_requests=24), seed=2).steps())
    assert max(max(s.query_lens) for s in plain if max(s.query_lens) <= 1 + k) == 1  # no drafts without k


def test_buckets_generate_knows_the_draft_tokens(tmp_path):
    out = tmp_path / "plan.json"
    proc = subprocess.run([sys.executable, "-m", "vllm_gaudi_unified", "buckets", "generate", "--strategy",
                           "exponential", "--preset", "bs32-seqs64", "--num-speculative-tokens", "3", "-o", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    plan = BucketPlan.load(str(out))
    assert plan.settings.num_speculative_tokens == 3
    assert "--num-speculative-tokens 3" in plan.info["command"]


@pytest.mark.parametrize("preset", ["bs32-seqs64", "llama8b-gaudi3"])
def test_speculative_plan_adds_at_most_a_quarter_more_graphs(preset):
    """A plan for num_speculative_tokens = 3: its verify steps' units are planner options (rows per request),
    not a bucket size, so the graphs it adds are the drafts' causal cells alone: at most +25 %."""
    from dataclasses import replace

    from vllm_gaudi_unified.bucket_plans.settings import PRESETS

    plain = exponential_plan(PRESETS[preset])
    spec = exponential_plan(replace(PRESETS[preset], num_speculative_tokens=3))
    assert spec.settings.options.unique_tokens == 4 and plain.settings.options.unique_tokens == 1
    assert len(spec) <= 1.25 * len(plain)


def test_a_verify_step_runs_in_its_speculative_bucket():
    """A ragged verify step (0-3 drafts) planned with the plan's options reads each request's blocks once (its
    unique units), pads into one of the plan's buckets and matches the reference there; warmup's batch for
    that bucket plans with the same options."""
    from conftest import Step, assert_matches, make_block_table, make_tensors

    from vllm_gaudi_unified import build_unified_batch, unified_attention
    from vllm_gaudi_unified.reference import reference_attention
    from vllm_gaudi_unified.warmup import batch_for_bucket

    spec = exponential_plan(ServerSettings(**SETTINGS, num_speculative_tokens=3))
    rng = np.random.default_rng(3)
    step = Step(list(rng.integers(1, 5, 12)), list(rng.integers(1, 200, 12)), 32)
    table, nb = make_block_table(step, rng)
    opts = spec.settings.options
    shape = plan_step(step.query_lens, step.context_lens, table, 32, options=opts).shape
    assert shape.phase == "c-u" and shape.num_prompts == 0
    bucket = spec.find(shape)
    assert bucket is not None and bucket.num_causal_tiles <= speculative_causal_tiles(bucket.query_len, 64, 3)
    q, k, v, kc, vc = make_tensors(step, table, nb)
    batch = build_unified_batch(step.query_lens, step.context_lens, table, 32, options=opts, bucket=bucket)
    assert batch.plan.unique_units == 4
    ref = reference_attention(q, k, v, kc, vc, step.query_lens, step.context_lens, table, 0.3)
    assert_matches(unified_attention(q, k, v, kc, vc, batch, 0.3), ref)
    warm = batch_for_bucket(bucket, 32, opts, None, "cpu")
    assert warm.bucket == bucket and warm.plan.unique_units == 4
