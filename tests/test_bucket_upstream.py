"""The upstream plan rebuilt from its rules: 107 graphs at the 8B setting, its lookup and its work."""

import numpy as np

from vllm_gaudi_unified.bucket_plans.cost import CostModel, Hardware, ModelSpec
from vllm_gaudi_unified.bucket_plans.settings import PRESETS
from vllm_gaudi_unified.tools.shapes import _arrays_of_steps
from vllm_gaudi_unified.bucket_plans.trace import TraceStep
from vllm_gaudi_unified.tools.upstream import (find_upstream, log_points, step_tuples, upstream_buckets,
                                                   upstream_work)


def test_107_graphs_at_the_8b_setting():
    b = upstream_buckets(PRESETS["llama8b-gaudi3"])
    assert len(b) == 107
    assert sorted(set(b[:, 0])) == [256, 512, 1280, 3072, 8192]
    assert sorted(set(b[:, 1])) == [0, 64, 256] and sorted(set(b[:, 2])) == [0, 256, 512, 1024, 2304, 6000]
    assert log_points(1, 8192, 256) == [256, 512, 1280, 3072, 8192]


def test_lookup_is_the_first_covering_bucket_in_sorted_order():
    b = upstream_buckets(PRESETS["llama8b-gaudi3"])
    rng = np.random.default_rng(0)
    steps = np.stack([rng.integers(1, 9000, 300), rng.integers(0, 300, 300), rng.integers(0, 7000, 300),
                      rng.integers(0, 2, 300)], 1)
    got = find_upstream(b, steps)
    rows = [tuple(r) for r in b.tolist()]
    for s, g in zip(steps.tolist(), got):
        want = next((i for i, r in enumerate(rows) if r >= tuple(s) and all(r[d] >= s[d] for d in range(3))), -1)
        assert g == want


def test_step_tuples_against_a_loop():
    rng = np.random.default_rng(1)
    steps = []
    for _ in range(20):
        n = int(rng.integers(1, 6))
        q = rng.integers(1, 4, n) * (rng.random(n) < 0.5) + 1
        ctx = rng.integers(0, 40, n)
        prefix = list(rng.permutation(np.arange(1, 200))[:3])
        ids = []
        for r in range(n):
            own = list(rng.permutation(np.arange(200, 400))[:20])
            need = -(-(q[r] + ctx[r]) // 8)
            ids.append((prefix + own)[:need] if r % 2 else own[:need])
        steps.append(TraceStep(8, q, ctx, ids))
    got = step_tuples(_arrays_of_steps(steps), 8)
    for s, g in zip(steps, got):
        users = {}
        for r in range(s.num_requests):
            for blk in s.block_ids[r][:-(-int(s.context_lens[r]) // 8)]:
                users[blk] = users.get(blk, 0) + int(s.query_lens[r])
        shared = sum(1 for u in users.values() if u > 1)
        unique = max([b for b, u in users.items() if u == 1], default=-1) + 1
        assert g.tolist() == [int(s.query_lens.sum()), shared, unique, int((s.query_lens > 1).any())]


def test_work_counts_causal_slices_of_512_rows():
    cost = CostModel(ModelSpec(), Hardware(), 128, PRESETS["llama8b-gaudi3"].options)
    for q in (1, 300, 512, 513, 1500):
        pairs, _ = upstream_work(np.array([[q, 2, 3, 1]]), cost)
        causal = sum(min(512, q - lo) * min(q, lo + 512) for lo in range(0, q, 512))
        assert pairs[0] == causal + q * 2 * 128 + 3 * 128
    pairs, time = upstream_work(np.array([[4, 0, 3, 0]]), cost)
    assert pairs[0] == 3 * 128 and time[0] > 0
