"""Decode steps (one new token per request, no window) for the test that holds the decode branch of
the planner to the planner before shared prefixes were planned per step (`test_host_planning.py`): no sharing, one group sharing a
prefix (partly filled last blocks included), several groups, nested prefixes, repeated ids by
chance, ids far beyond the step, bad ids. numpy only, and `PlanOptions` imported when called, so the
digests can be written by another checkout's planner (`python tests/plan_decode_steps.py OUT`)."""
import importlib.util
import json
import sys
from pathlib import Path

import numpy as np


def decode_steps():
    """(name, args, kwargs) of each step, the same on every run."""
    from vllm_gaudi_unified.plan import PlanOptions

    # (shared rows pinned to 8, the default the digests were written with; the default is 16 now)
    options = [PlanOptions(shared_rows=8), PlanOptions(shared_rows=8, unique_layout="slice"),
               PlanOptions(shared_rows=8, unique_layout="gather"),
               PlanOptions(shared_rows=4, shared_tile_keys=32), PlanOptions(shared_rows=3, shared_tile_keys=8,
                                                                              unique_layout="slice")]
    # the shared tiles' rows fixed, as before they were chosen per step (`PlanOptions.tile_rows`)
    options = [o.with_tile_rows(o.shared_rows) if hasattr(o, "with_tile_rows") else o for o in options]
    rng = np.random.default_rng(23)
    for it in range(500):
        R, bs = int(rng.integers(1, 300)), int(rng.choice([1, 4, 16, 128]))
        ctx = rng.integers(0, 40 * bs, R)
        if rng.random() < 0.3:
            ctx[rng.random(R) < 0.2] = 0
        nb = -(-ctx // bs)
        width = max(int(nb.max()) + int(rng.integers(0, 3)), 1)
        nblocks = int(rng.integers(max(R * width // 4, width), 4 * R * width + 2))
        if rng.random() < 0.7:  # a free list: no id twice
            bt = rng.permutation(max(nblocks, R * width))[:R * width].reshape(R, width)
        else:  # ids by chance: some repeat
            bt = rng.integers(0, nblocks, (R, width))
        mode = it % 4  # 0: as is; 1: one group; 2: several groups; 3: nested prefixes
        for _ in range({0: 0, 1: 1, 2: int(rng.integers(2, 5)), 3: 3}[mode]):
            users = np.flatnonzero(rng.random(R) < rng.random())
            if mode == 3 and _ > 0:  # a longer prefix for some of the previous users
                users = users[: max(users.size // 2, 1)]
            if not users.size:
                continue
            # mostly blocks every user needs (one group of users per prefix), else any length
            pref = int(rng.integers(0, (nb[users].min() if rng.random() < 0.7 else width) + 1))
            bt[users, :pref] = bt[users[0], :pref]
            if pref and rng.random() < 0.3:  # sequences that end inside the common blocks
                ends = rng.random(users.size) < (1.0 if mode == 1 else 0.5)  # one group: all of them, alike
                ctx[users[ends]] = int(rng.integers((pref - 1) * bs + 1 if mode == 1 else 1, pref * bs + 1))
                nb = -(-ctx // bs)
        if rng.random() < 0.05:
            bt = bt * 100003
        if rng.random() < 0.04:
            bt[0, 0] = -1
        num_blocks = None if rng.random() < 0.5 else int(bt.max()) + 1 + int(rng.integers(0, 3)) - (rng.random() < 0.05)
        yield f"decode:{it}", (np.ones(R, np.int64), ctx, bt, bs), dict(options=options[it % 5], num_blocks=num_blocks)
    bench = _benchmark()  # the planning benchmark's steps
    for name, (q, ctx, bt) in bench.decode_scenarios().items():
        for i, opts in enumerate(options[:3]):
            yield f"bench:{name}:{i}", (q, ctx, bt, 128), dict(options=opts, num_blocks=bench.DECODE_NUM_BLOCKS)


def _benchmark():
    """This checkout's `benchmarks/planning.py`, by path (another checkout's package may be first)."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "planning.py"
    spec = importlib.util.spec_from_file_location("_planning_benchmark", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


if __name__ == "__main__":  # write the digests with the planner first on the path
    from test_host_planning import plan_digest

    json.dump({name: plan_digest(args, kw) for name, args, kw in decode_steps()}, open(sys.argv[1], "w"), indent=0)
