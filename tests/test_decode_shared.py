"""The decode branch's shared-prefix split (`plan/decode_shared.py`) against the general path.

The digests of `test_host_planning.py` hold the decode branch to the earlier planner over
506 recorded steps, but few of them are one group of requests sharing full blocks, the case
`one_full_group` lays out without grouping. Here every step is planned twice, by the decode branch
and by the general path (`default._plan_decodes` disabled), and the plans must be equal field by
field and bit for bit, with new arrays and into kept buffers; most steps are one full group, some
end inside the shared blocks, hold a shared block twice, or share with several groups.
"""
import numpy as np
import pytest

from vllm_gaudi_unified import plan_step
from vllm_gaudi_unified.plan import PlanBuffers, PlanOptions, StepPlan, decode_shared, default
from vllm_gaudi_unified.plan.arrays import counting, prefix_mask

OPTIONS = [PlanOptions(), PlanOptions(unique_layout="gather"), PlanOptions(unique_layout="slice"),
           PlanOptions(shared_rows=3, shared_tile_keys=8), PlanOptions(shared_rows=1, shared_tile_keys=1),
           PlanOptions(shared_rows=16, shared_tile_keys=64, unique_layout="gather"),
           PlanOptions(shared_rows=3, shared_rows_max=3, shared_tile_keys=8)]  # rows fixed: several row chunks


def _steps(n=400, seed=5):
    rng = np.random.default_rng(seed)
    for it in range(n):
        R, bs = int(rng.integers(1, 80)), int(rng.choice([1, 4, 16, 128]))
        ctx = rng.integers(1, 30 * bs, R)
        nb = -(-ctx // bs)
        width = int(nb.max()) + int(rng.integers(0, 2))
        nblocks = int(rng.integers(R * width, 6 * R * width + 2))
        bt = rng.permutation(nblocks)[:R * width].reshape(R, width)
        kind = it % 5  # 0-2: one group of full blocks; 3: ending inside them; 4: several groups
        users = np.flatnonzero(rng.random(R) < rng.random())
        if users.size:
            pref = int(rng.integers(1, nb[users].min() + 1))
            if kind < 3:  # full blocks: every user's context goes past the prefix (or ends at its end)
                pref = max(min(pref, int(nb[users].min()) - int(rng.random() < 0.8)), 1)
                ctx[users] = np.maximum(ctx[users], pref * bs)
            bt[users, :pref] = bt[users[0], :pref]
            if kind == 3:
                ctx[users[rng.random(users.size) < 0.5]] = int(rng.integers((pref - 1) * bs + 1, pref * bs + 1))
            if kind == 4:
                others = np.setdiff1d(np.arange(R), users)[: int(rng.integers(0, R))]
                if others.size:
                    k = int(rng.integers(1, nb[others].min() + 1))
                    bt[others, :k] = bt[others[0], :k]
        if it % 17 == 0:  # one request holding a block twice
            r = int(rng.integers(R))
            if nb[r] > 1:
                bt[r, nb[r] - 1] = bt[r, 0]
        yield (np.ones(R, np.int64), ctx, bt, bs), dict(options=OPTIONS[it % len(OPTIONS)], num_blocks=nblocks)


def _same(a: StepPlan, b: StepPlan, what: str) -> None:
    for name, x in a.__dict__.items():
        if name.startswith("prompt_"):  # (the general path carries empty prompt arrays, the decode branch none)
            continue
        y = b.__dict__[name]
        if isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
            assert x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y), (what, name)
        else:
            assert x == y, (what, name, x, y)


def test_decode_branch_plans_shared_prefixes_as_the_general_path_does(monkeypatch):
    calls = {"one_full_group": 0, "laid_out": 0}
    one_full_group = decode_shared.one_full_group

    def counted(*args):
        calls["one_full_group"] += 1
        tiles = one_full_group(*args)
        calls["laid_out"] += tiles is not None
        return tiles

    monkeypatch.setattr(decode_shared, "one_full_group", counted)
    steps = list(_steps())
    fast = [plan_step(*args, **kw) for args, kw in steps]
    buffers = PlanBuffers()
    kept = []
    for args, kw in steps:
        plan = plan_step(*args, buffers=buffers, **kw)
        kept.append({k: v.copy() if isinstance(v, np.ndarray) else v for k, v in plan.__dict__.items()})
    monkeypatch.setattr(default, "_plan_decodes", lambda *args: None)
    for i, (args, kw) in enumerate(steps):
        general = plan_step(*args, **kw)
        _same(fast[i], general, (i, "new arrays"))
        for name, v in kept[i].items():
            if not name.startswith("prompt_"):
                g = general.__dict__[name]
                assert (np.array_equal(v, g) and v.shape == g.shape) if isinstance(v, np.ndarray) else v == g, (i, name)
    # the steps reach the fast layout often, and the general grouping too
    assert calls["laid_out"] > 100 and calls["one_full_group"] - calls["laid_out"] > 30, calls


@pytest.mark.parametrize("width", [1, 5, 64, 1024, 1025])
def test_prefix_mask_and_counting(width):
    rng = np.random.default_rng(width)
    lengths = rng.integers(0, width + 1, 50)
    assert np.array_equal(prefix_mask(lengths, width), np.arange(width) < lengths[:, None])
    assert prefix_mask(lengths[:0], width).shape == (0, width)
    c = counting(width)
    assert c.dtype == np.int32 and np.array_equal(c, np.arange(width)) and not c.flags.writeable
