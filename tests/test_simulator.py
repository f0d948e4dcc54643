"""The workload simulator schedules like vLLM's v1 scheduler."""
import collections

import numpy as np
import pytest

from vllm_gaudi_unified.bucket_plans.simulator import SchedulerConfig, Simulator, simulate
from vllm_gaudi_unified.bucket_plans.workloads import WorkloadConfig, workload_from

SCHED = SchedulerConfig(block_size=16, max_num_seqs=8, max_num_batched_tokens=128, max_model_len=1024,
                        num_blocks=300)
WORK = WorkloadConfig(num_requests=40, arrival_rate=0.5, prompt_median=100, prompt_max=600, output_median=30,
                      output_max=120, prefix_share=0.5, prefix_lens=(48, 64), followup_share=0.3,
                      parallel_share=0.2, parallel_n=3)


def run(sched=SCHED, work=WORK, seed=0):
    sim = Simulator(sched, work, seed)
    return sim, list(sim.steps())


def test_same_seed_same_trace_other_seed_other_trace():
    a = [s.to_json() for s in simulate(SCHED, WORK, seed=3)]
    b = [s.to_json() for s in simulate(SCHED, WORK, seed=3)]
    c = [s.to_json() for s in simulate(SCHED, WORK, seed=4)]
    assert a == b and a != c


def test_budget_seqs_and_block_table_invariants():
    sim, steps = run()
    assert sim.done and sim.num_preemptions == 0
    for s in steps:
        assert s.query_lens.sum() <= SCHED.max_num_batched_tokens
        assert s.num_requests <= SCHED.max_num_seqs
        assert (s.query_lens >= 1).all() and (s.context_lens + s.query_lens <= SCHED.max_model_len).all()
        owner = {}
        for r, ids in enumerate(s.block_ids):
            assert len(ids) == -(-(s.context_lens[r] + s.query_lens[r]) // SCHED.block_size)
            assert len(set(ids)) == len(ids) and 0 not in ids and max(ids) < SCHED.num_blocks
            for pos, b in enumerate(ids):
                # A block in two requests is a shared prefix: same position, full, already computed.
                if b in owner:
                    r0, pos0 = owner[b]
                    assert pos0 == pos
                    assert (pos + 1) * SCHED.block_size <= min(s.context_lens[r] + s.query_lens[r],
                                                               s.context_lens[r0] + s.query_lens[r0])
                owner[b] = (r, pos)


def test_requests_progress_from_step_to_step():
    """A request's context grows by exactly what it was scheduled, until it finishes or is preempted."""
    sim = Simulator(SCHED, WORK, 1)
    computed = {}
    while not sim.done:
        sim._admit_arrivals()
        scheduled = sim.schedule()
        sim.step_index += 1
        for req, ctx, n in scheduled:
            if req.rid in computed:  # no preemption in this setting: exactly where it stopped
                assert ctx == computed[req.rid] and sim.num_preemptions == 0
        sim._finish_step(scheduled)
        for req, ctx, n in scheduled:
            computed[req.rid] = ctx + n
    for req in sim.finished:
        assert req.num_tokens - req.prompt_len == req.max_tokens or req.num_tokens >= SCHED.max_model_len
    assert len(sim.finished) == len(computed)


def test_chunked_prefill_and_decodes_first():
    work = WorkloadConfig(num_requests=6, arrival_rate=0.0, prompt_median=400, prompt_sigma=0.01, prompt_max=600,
                          output_median=5, output_sigma=0.01, output_max=5, prefix_share=0.0, followup_share=0.0)
    _, steps = run(work=work)
    first = steps[0]
    assert first.query_lens.tolist() == [128]  # the budget cuts the first prompt: chunked prefill
    assert steps[1].context_lens[0] == 128
    for s in steps:
        decodes = s.query_lens == 1
        if decodes.any() and (~decodes).any():
            # running requests (decodes, continuing chunks) come before newly admitted ones
            assert s.context_lens[-1] == 0 or s.context_lens[0] > 0


def test_prefix_caching_hits_and_parallel_children_share_prompt():
    work = WorkloadConfig(num_requests=1, arrival_rate=0.0, prompt_median=100, prompt_sigma=0.01, prompt_max=200,
                          output_median=10, output_sigma=0.01, output_max=20, prefix_share=0.0,
                          followup_share=0.0, parallel_share=1.0, parallel_n=3)
    sched = SchedulerConfig(block_size=16, max_num_seqs=8, max_num_batched_tokens=512, max_model_len=1024,
                            num_blocks=300)
    _, steps = run(sched, work)
    first = steps[0]
    # Child 1 computes the prompt; children 2 and 3 hit its 6 full blocks in the same step.
    assert first.context_lens.tolist() == [0, 96, 96]
    assert first.block_ids[1][:6] == first.block_ids[0][:6] == first.block_ids[2][:6]
    no_cache = SchedulerConfig(block_size=16, max_num_seqs=8, max_num_batched_tokens=512, max_model_len=1024,
                               num_blocks=300, enable_prefix_caching=False)
    assert next(Simulator(no_cache, work, 0).steps()).context_lens.tolist() == [0, 0, 0]


def test_free_list_spreads_block_ids_over_the_cache():
    work = workload_from("chat", num_requests=150, arrival_rate=1.0, output_median=40, output_max=100)
    sched = SchedulerConfig(block_size=16, max_num_seqs=16, max_num_batched_tokens=256, max_model_len=2048,
                            num_blocks=2000)
    _, steps = run(sched, work)
    late = steps[len(steps) * 3 // 4:]
    ids = np.concatenate([np.concatenate([np.asarray(b) for b in s.block_ids]) for s in late])
    assert ids.max() > 0.9 * sched.num_blocks  # LRU reuse walks the whole cache
    counts = collections.Counter(tuple(s.block_ids[0][:3]) for s in late if len(s.block_ids[0]) >= 3)
    assert counts  # system prompt blocks are reused


def test_preemption_when_blocks_run_out():
    work = WorkloadConfig(num_requests=20, arrival_rate=0.0, prompt_median=200, prompt_max=300,
                          output_median=300, output_max=400, prefix_share=0.0, followup_share=0.0)
    sched = SchedulerConfig(block_size=16, max_num_seqs=16, max_num_batched_tokens=512, max_model_len=1024,
                            num_blocks=120)
    sim, steps = run(sched, work)
    assert sim.num_preemptions > 0 and sim.done and len(sim.finished) == 20
    for s in steps:
        assert len({b for ids in s.block_ids for b in ids}) <= sched.num_blocks - 1


def test_bad_configs():
    with pytest.raises(ValueError, match="max_num_batched_tokens .* below max_num_seqs"):
        SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=32)
    with pytest.raises(ValueError, match="prefix_share"):
        WorkloadConfig(prefix_share=1.5)
    with pytest.raises(ValueError, match="unknown workload"):
        workload_from("nope")
    with pytest.raises(ValueError, match="without chunked prefill"):
        SchedulerConfig(max_num_batched_tokens=2048, max_model_len=8192, enable_chunked_prefill=False)
