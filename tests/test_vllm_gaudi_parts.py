"""Steps in parts through the Gaudi plugin (`vllm_plugin/hpu_parts.py`), against vllm-gaudi's real code on the
CPU stand-in: a plan in parts is accepted in vllm-gaudi's torch.compile mode and refused in its lazy mode; a step
in parts through vllm-gaudi's `Attention.forward` and the unified impl equals the step whole and the dense
reference; under torch.compile (vllm-gaudi's regional compilation of a decoder layer, a counting backend in place
of `"hpu_backend"`) the attention compiles one graph per bucket or grid graph it meets (a sum, not one per
pair) and the layer's graphs depend on its row count only."""
from __future__ import annotations

from collections import Counter
from dataclasses import replace

import numpy as np
import pytest
import torch

from conftest import Step, make_block_table, make_tensors
from test_vllm_gaudi import _attention_layer, gaudi, runner_setup  # noqa: F401  (fixtures: stand-in, vllm-gaudi)
from vllm_gaudi_unified import build_unified_batch, graphs, step_parts
from vllm_gaudi_unified.bucket_plans import ModelSpec, ServerSettings, TraceStep
from vllm_gaudi_unified.bucket_plans.exponential import exponential_plan
from vllm_gaudi_unified.reference import reference_attention
from vllm_gaudi_unified.step_parts import build_step_parts, in_parts, learn_grid_graphs
from vllm_gaudi_unified.vllm_plugin.hpu_kinds import FULL

pytestmark = pytest.mark.vllm

BS, HQ, HKV, D = 4, 4, 2, 16
SETTINGS = ServerSettings(block_size=BS, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64, num_blocks=96)
MODEL = ModelSpec(num_layers=1, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D, hidden_size=64, vocab_size=64)
#: prompts (query lens, context lens) beside decode loads: every pair a step of a grid part and a rest
PROMPTS = {"A": ([12], [20]), "B": ([9, 7], [6, 0])}
DECODES = {"1": ([1], [9]), "3": ([1, 1, 1], [17, 30, 5]), "5": ([1] * 5, [40, 9, 17, 22, 3])}
HEADS = dict(num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D, num_blocks=96)  # one cache size for every step
STEPS = {p + d: Step(dq[:1] + pq + dq[1:], dc[:1] + pc + dc[1:], BS, **HEADS)
         for p, (pq, pc) in PROMPTS.items() for d, (dq, dc) in DECODES.items()}
STEPS["2whole"] = Step([1, 1], [33, 6], BS, **HEADS)  # decodes alone: whole
STEPS["5whole"] = Step(*DECODES["5"], BS, **HEADS)  # whole, in the bucket of A5's and B5's rest


@pytest.fixture(autouse=True)
def free_calls(monkeypatch):
    """The tiny model's steps cost a fraction of a µs: a second call at the 8B setting's price would never pay."""
    monkeypatch.setattr(step_parts, "PART_CALL_US", 0.0)


@pytest.fixture(scope="module")
def case():
    """A plan in parts learned from `STEPS` (the exponential buckets, a grid graph per prompt shape), and each
    step's block table and cache size."""
    rng = np.random.default_rng(0)
    tables = {name: make_block_table(s, rng) for name, s in STEPS.items()}
    learn = [TraceStep(BS, np.array(s.query_lens), np.array(s.context_lens),
                       [list(map(int, row[:-(-(q + c) // BS)])) for row, q, c in zip(t, s.query_lens, s.context_lens)])
                      for (s, (t, _)) in zip(STEPS.values(), tables.values())]
    tiled = exponential_plan(SETTINGS, MODEL)
    old = step_parts.PART_CALL_US
    step_parts.PART_CALL_US = 0.0
    try:
        grids, _ = learn_grid_graphs(tiled, learn, 4)
    finally:
        step_parts.PART_CALL_US = old
    plan = replace(tiled, prompt_graphs=grids, info={**tiled.info, "parts": True})
    assert in_parts(plan) and len(grids) == len(PROMPTS)
    return plan, tables


def _runner_of(groups: int = 1, use_mla: bool = False, speculative_config=None, is_pooling_model: bool = False):
    """What `hpu_parts.parts_support` reads of the unified runner."""
    from types import SimpleNamespace

    return SimpleNamespace(model_config=SimpleNamespace(enforce_eager=False, use_mla=use_mla),
                           kv_cache_config=SimpleNamespace(kv_cache_groups=[None] * groups),
                           speculative_config=speculative_config, is_pooling_model=is_pooling_model)


def _vllm_gaudi_inputs(step: Step, table: np.ndarray, num_blocks: int, rows: int, seed: int = 0):
    """q/k/v of `step` (float64) padded to `rows` (NaN padding rows), vllm-gaudi's flat caches
    (`[(num_blocks + 1) * BS, Hkv, D]`, unread slots NaN / inf), the tokens' slots padded with the extra block's."""
    q, k, v, kc, vc = make_tensors(step, table, num_blocks, torch.float64, seed)
    n = q.shape[0]
    pad = lambda x: torch.cat([x, x.new_full((rows - n, *x.shape[1:]), float("nan"))])  # noqa: E731
    caches = [torch.cat([c.reshape(-1, HKV, D), c.new_full((BS, HKV, D), float("nan"))]) for c in (kc, vc)]
    req = np.repeat(np.arange(len(step.query_lens)), step.query_lens)
    starts = np.cumsum(step.query_lens) - step.query_lens
    pos = np.asarray(step.context_lens)[req] + np.arange(n) - starts[req]
    slots = np.full(rows, num_blocks * BS, np.int64)
    slots[:n] = table[req, pos // BS] * BS + pos % BS
    ref = reference_attention(q, k, v, kc, vc, step.query_lens, step.context_lens, table, D ** -0.5)
    return (pad(q), pad(k), pad(v)), caches, torch.from_numpy(slots), ref


def _metadata(plan, step: Step, table, num_blocks, graph_backend=None, whole: bool = False):
    """The step's `UnifiedHpuMetadata` as the runner makes it (`hpu_parts.metadata_in_parts`): in parts, or whole
    padded to its bucket; and its model rows."""
    from vllm_gaudi_unified.vllm_plugin.hpu_backend import UnifiedHpuMetadata
    from vllm_gaudi_unified.vllm_plugin.hpu_parts import model_rows

    parts = None if whole else build_step_parts(step.query_lens, step.context_lens, table, plan, num_blocks=num_blocks)
    if parts is None:
        batch = build_unified_batch(step.query_lens, step.context_lens, table, BS, num_blocks=num_blocks,
                                    options=plan.settings.options, bucket=plan)  # (`StepHooks.create`)
        return batch, None, batch.bucket.query_len
    return parts.batches[0], parts, model_rows(plan, parts.num_tokens)


def _layer_forward(layer, config, md_args, x):
    from vllm.forward_context import set_forward_context

    from vllm_gaudi_unified.vllm_plugin.hpu_backend import UnifiedHpuMetadata

    batch, parts, slots, backend = md_args
    md = {layer.layer_name: UnifiedHpuMetadata(batch=batch, slot_mapping=slots, parts=parts, graph_backend=backend)}
    with set_forward_context(md, config), torch.inference_mode():  # as every serving step runs
        return x(layer)


@pytest.mark.parametrize("name", ["A3", "B5"])
def test_a_step_in_parts_through_the_gaudi_impl_equals_the_step_whole(gaudi, case, name):  # noqa: F811
    """vllm-gaudi's `Attention.forward` -> the unified impl, the step in parts (eagerly, and by a compiled
    function per part's graph behind the graph break), against the same step whole and the dense reference
    (float64, 1e-6); padding rows come out zero."""
    plan, tables = case
    step, (table, nb) = STEPS[name], tables[name]
    layer, config = _attention_layer(f"parts.{name}", HQ, HKV, D, D ** -0.5)
    outs = {}
    for how in ("parts", "parts_compiled", "whole"):
        batch, parts, rows = _metadata(plan, step, table, nb, whole=how == "whole")
        assert (parts is None) == (how == "whole")
        (q, k, v), caches, slots, ref = _vllm_gaudi_inputs(step, table, nb, rows)
        layer.kv_cache = (*caches, None, None)
        backend = "eager" if how == "parts_compiled" else None
        out = _layer_forward(layer, config, (batch, parts, slots, backend),
                             lambda lay: lay(*(x.reshape(1, rows, -1) for x in (q, k, v)))).reshape(rows, HQ, D)
        n = ref.shape[0]
        assert torch.isfinite(out[:n]).all(), "a poisoned cache slot was read"
        torch.testing.assert_close(out[:n], ref, atol=1e-6, rtol=1e-6)
        if parts is not None:
            assert rows > n and (out[n:] == 0).all()
        outs[how] = out[:n]
    torch.testing.assert_close(outs["parts"], outs["whole"], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(outs["parts_compiled"], outs["parts"], atol=1e-6, rtol=1e-6)


class _Decoder(torch.nn.Module):
    """A decoder layer's attention block as vllm-gaudi's regional compilation compiles it (one region per child
    of the model's `nn.ModuleList`): projections around vLLM's `Attention` (vllm-gaudi's `Attention.forward`)."""

    def __init__(self, attn):
        super().__init__()
        g = torch.Generator().manual_seed(1)
        self.attn = attn
        self.qkv = torch.nn.Parameter(torch.randn(32, (HQ + 2 * HKV) * D, generator=g, dtype=torch.float64) / 8,
                                      requires_grad=False)
        self.o = torch.nn.Parameter(torch.randn(HQ * D, 32, generator=g, dtype=torch.float64) / 8, requires_grad=False)

    def forward(self, x):
        q, k, v = (x @ self.qkv).split([HQ * D, HKV * D, HKV * D], dim=-1)
        return torch.relu(self.attn(q, k, v) @ self.o) + x


def _counting(name: str, counts: Counter):
    def backend(gm, example_inputs):
        counts[name] += 1
        return gm.forward
    return backend


def test_compiled_attention_graphs_are_keyed_by_part_shapes_and_layers_by_rows(gaudi, case):  # noqa: F811
    """Six steps in parts, every (prompt shape, decode load) pair, two steps of decodes whole (one in a bucket
    met as a part's), then the first step again, through a compiled decoder layer (vllm-gaudi's torch.compile mode: `fullgraph` off, dynamic shapes; a
    counting backend as the layer's and the attention's): the attention compiles once per bucket or grid graph
    met (2 grid graphs + 3 buckets for the 6 pairs, + a whole step's bucket), never for a pair of graphs
    already met nor for a bucket met as a part and then whole; the layer compiles per row count (the graphs before and after the graph break), never for a
    new pair at a row count met; every step equals the layer over the dense reference's attention."""
    plan, tables = case
    counts = Counter()
    attention_backend = _counting("attention", counts)
    graphs.clear()
    layer, config = _attention_layer("parts.compiled", HQ, HKV, D, D ** -0.5)
    decoder = _Decoder(layer)
    compiled = torch.compile(decoder, backend=_counting("layer", counts), fullgraph=False)
    met, layer_counts, pairs = set(), {}, set()
    for name in list(STEPS) + ["A1"]:  # (5whole: a bucket met as a part's, now whole: no new graph)
        step, (table, nb) = STEPS[name], tables[name]
        batch, parts, rows = _metadata(plan, step, table, nb)
        assert (parts is None) == name.endswith("whole")
        (q, _, _), caches, slots, ref = _vllm_gaudi_inputs(step, table, nb, rows)
        layer.kv_cache = (*caches, None, None)
        g = torch.Generator().manual_seed(len(met))
        x = torch.randn(1, rows, 32, generator=g, dtype=torch.float64)
        before = dict(counts)
        out = _layer_forward(layer, config, (batch, parts, slots, attention_backend), lambda _: compiled(x))
        # the same layer, eagerly, over the dense reference's attention
        n = ref.shape[0]
        qkv = (x[0, :n] @ decoder.qkv).split([HQ * D, HKV * D, HKV * D], dim=-1)
        kc, vc = (c[:-BS].reshape(nb, BS, HKV, D) for c in caches)
        expect = reference_attention(*(t.reshape(n, -1, D) for t in qkv), kc, vc, step.query_lens, step.context_lens,
                                     table, D ** -0.5)
        torch.testing.assert_close(out[0, :n], torch.relu(expect.reshape(n, -1) @ decoder.o) + x[0, :n], atol=1e-6,
                                   rtol=1e-6)
        new = (parts.buckets if parts is not None else (batch.bucket,))
        fresh = [b for b in new if b not in met]
        assert counts["attention"] - before.get("attention", 0) == len(fresh), (name, new)
        met.update(new)
        pairs.add(new)
        if rows in layer_counts:
            assert counts["layer"] == before.get("layer", 0), f"{name}: the layer compiled again at {rows} rows"
        layer_counts[rows] = counts["layer"]
    in_parts_pairs = {p for p in pairs if len(p) == 2}
    assert len(in_parts_pairs) == 6 and len({g for p in in_parts_pairs for g in p}) == 2 + 3  # a sum, not a product
    assert counts["attention"] == len(met) == 2 + 3 + 1  # and the whole step's bucket
    assert sorted(layer_counts) == [2, 8, 16, 32]  # buckets' row counts (`hpu_parts.model_rows`): whole, and in parts
    assert counts["layer"] <= 2 * len(layer_counts)  # per row count at most the graphs before and after the break


def test_lazy_mode_refuses_a_plan_in_parts_and_torch_compile_mode_accepts_it(gaudi, case, tmp_path):  # noqa: F811
    """At start-up (`StepHooks.create` through `_load_bucket_plan`, with `hpu_parts.parts_support`): lazy mode
    names itself and PT_HPU_LAZY_MODE; torch.compile mode loads the plan, its attention on `"hpu_backend"`
    (eager with enforce_eager); the CPU/CUDA path keeps refusing."""
    from types import SimpleNamespace

    from vllm_gaudi_unified.plan import PlanOptions
    from vllm_gaudi_unified.vllm_plugin import hpu_parts
    from vllm_gaudi_unified.vllm_plugin.steps import _load_bucket_plan

    plan, _ = case
    path = str(tmp_path / "parts.json")
    plan.save(path)
    config = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=8, max_num_batched_tokens=64))
    kv = SimpleNamespace(block_size=BS)
    runner = _runner_of()
    kinds = {FULL: ["layer"]}
    gaudi.lazy = True
    try:
        support = hpu_parts.parts_support(runner, kinds)
    finally:
        gaudi.lazy = False
    assert support["graph_backend"] is None and support["whole_steps"] is None
    with pytest.raises(ValueError, match=r"VLLM_GAUDI_UNIFIED_BUCKETS=.*parts.json: a plan of grid graphs .* lazy mode "
                                         r"\(PT_HPU_LAZY_MODE=1\).*torch.compile mode \(PT_HPU_LAZY_MODE=0\)"):
        _load_bucket_plan(path, config, kv, PlanOptions(), None, parts_refusal=support["parts_refusal"])
    support = hpu_parts.parts_support(runner, kinds)
    assert support == {"parts_refusal": None, "whole_steps": None, "graph_backend": "hpu_backend"}
    loaded = _load_bucket_plan(path, config, kv, PlanOptions(), None, parts_refusal=support["parts_refusal"])
    assert in_parts(loaded) and loaded.prompt_graphs == plan.prompt_graphs
    runner.model_config.enforce_eager = True
    assert hpu_parts.parts_support(runner, kinds)["graph_backend"] is None
    with pytest.raises(ValueError, match="one attention call: make the plan without --parts"):
        _load_bucket_plan(path, config, kv, PlanOptions(), None)


def test_bad_input_to_a_step_in_parts_is_refused_by_name(gaudi, case):  # noqa: F811
    from vllm_gaudi_unified.vllm_plugin.hpu_backend import UnifiedHpuAttentionImpl, UnifiedHpuMetadata

    plan, tables = case
    step, (table, nb) = STEPS["A3"], tables["A3"]
    batch, parts, rows = _metadata(plan, step, table, nb)
    (q, k, v), caches, slots, _ = _vllm_gaudi_inputs(step, table, nb, rows)
    impl = UnifiedHpuAttentionImpl(HQ, D, D ** -0.5, HKV)
    cut = parts.num_tokens - 1  # the model's rows short of the step's tokens
    md = UnifiedHpuMetadata(batch=batch, slot_mapping=slots[:cut], parts=parts)
    with pytest.raises(ValueError, match=f"a step in parts of {parts.num_tokens} tokens, but the model gave {cut} "):
        impl.forward(None, *(x[:cut].reshape(1, cut, -1) for x in (q, k, v)), (*caches, None, None), md)
    md = UnifiedHpuMetadata(batch=batch, slot_mapping=slots, parts=parts.batches[1])
    with pytest.raises(ValueError, match="parts must be StepParts"):
        impl.forward(None, *(x.reshape(1, rows, -1) for x in (q, k, v)), (*caches, None, None), md)


def test_model_rows_and_logits_rows_of_a_step_in_parts(case):
    """The model rows: the fewest of a bucket holding the step's tokens, each plan its own (two plans, one made
    after the other is gone); the sampled rows: each request's last token in the flat step, from both parts, read
    from the host rows (the parts' device rows on the meta device, which cannot be read back, give the same)."""
    import gc

    from vllm_gaudi_unified.vllm_plugin.hpu_backend import UnifiedHpuMetadata
    from vllm_gaudi_unified.vllm_plugin.hpu_parts import model_rows

    plan, tables = case
    sizes = sorted({b.query_len for b in plan.buckets})
    assert [model_rows(plan, n) for n in (1, 13, 16, 17, sizes[-1], sizes[-1] + 1)] == \
        [1, 16, 16, 32, sizes[-1], sizes[-1] + 1]
    for _ in range(2):  # a plan of other buckets, made twice (the second may take the first one's id)
        other = replace(plan, buckets=[b for b in plan.buckets if b.query_len not in (1, 16)])
        assert [model_rows(other, n) for n in (1, 13, 17)] == [2, 32, 32]
        assert [model_rows(plan, n) for n in (1, 13, 17)] == [1, 16, 32]
        del other
        gc.collect()
    step, (table, nb) = STEPS["B3"], tables["B3"]
    batch, parts, rows = _metadata(plan, step, table, nb)
    old = np.sort(np.concatenate([r.cpu().numpy()[b.plan.logits_indices[:b.num_requests]]  # read back per step
                                  for b, r in zip(parts.batches, parts.rows)]))
    unread = replace(parts, rows=tuple(r.to("meta") for r in parts.rows))
    with pytest.raises(NotImplementedError):
        unread.rows[0].cpu()
    last = np.cumsum(step.query_lens) - 1
    for p in (parts, unread):
        md = UnifiedHpuMetadata(batch=batch, slot_mapping=torch.zeros(rows, dtype=torch.int64), parts=p)
        assert md.rows == rows and md.logits_rows(len(step.query_lens)).tolist() == last.tolist() == old.tolist()
    assert [h.tolist() for h in parts.host_rows] == [r.tolist() for r in parts.rows]


def test_steps_run_in_parts_only_for_one_group_of_full_attention(gaudi):  # noqa: F811
    """`hpu_parts.whole_steps`, which `parts_support` passes to `StepHooks.create` (and so to `auto`): None for
    one KV cache group of full attention, else why the group's steps run whole."""
    from vllm_gaudi_unified.vllm_plugin import hpu_parts
    from vllm_gaudi_unified.vllm_plugin.hpu_kinds import AttentionKind

    full, window = {FULL: ["a"]}, AttentionKind(sliding_window=8)
    assert hpu_parts.whole_steps(_runner_of(), full) is None
    cases = {"sliding windows": (_runner_of(), {window: ["a"]}),
             "attention other than full": (_runner_of(), {FULL: ["a"], window: ["b"]}),
             "several KV cache groups": (_runner_of(groups=2), full), "MLA": (_runner_of(use_mla=True), full),
             "speculative decoding": (_runner_of(speculative_config=object()), full),
             "a pooling model": (_runner_of(is_pooling_model=True), full)}
    for why, (runner, kinds) in cases.items():
        assert why in hpu_parts.whole_steps(runner, kinds) == hpu_parts.parts_support(runner, kinds)["whole_steps"]


def test_the_runner_plans_steps_in_parts_and_warms_every_graph(runner_setup, gaudi, monkeypatch,  # noqa: F811
                                                               tmp_path):
    """The unified runner (vllm-gaudi's `HPUModelRunner` subclass) with a plan in parts: a step of a prompt and
    decodes is planned in parts for every layer (model rows a bucket's, the sampled rows each request's last
    token), a step of decodes whole, every step's attention on the hooks' compile backend; warmup runs every
    bucket whole and every grid graph as a step in parts over a bucket's rows. In lazy mode the same plan stops
    the start-up."""
    from test_vllm_gaudi import C_BLOCK, C_BLOCKS, _scheduler_and_runner

    from vllm_gaudi_unified.vllm_plugin.hpu_parts import model_rows
    from vllm_gaudi_unified.vllm_plugin.hpu_step import HpuStep

    settings = ServerSettings(block_size=C_BLOCK, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=512,
                              num_blocks=C_BLOCKS)
    model = ModelSpec(num_layers=2, num_qo_heads=8, num_kv_heads=2, head_dim=32, hidden_size=256, vocab_size=512)
    q, c = np.array([1, 40, 1, 1]), np.array([70, 0, 33, 100])
    table = np.zeros((4, 8), np.int64)
    table[:, :5] = np.arange(1, 21).reshape(4, 5)
    blocks = [list(map(int, row[:-(-(a + b) // C_BLOCK)])) for row, a, b in zip(table, q, c)]
    tiled = exponential_plan(settings, model)
    grids, _ = learn_grid_graphs(tiled, [TraceStep(C_BLOCK, q, c, blocks)], 2)
    plan = replace(tiled, prompt_graphs=grids, info={**tiled.info, "parts": True})
    path = str(tmp_path / "parts.json")
    plan.save(path)
    gaudi.lazy = True
    try:
        with pytest.raises(ValueError, match=r"parts.json: a plan of grid graphs .*lazy mode \(PT_HPU_LAZY_MODE=1\)"):
            _scheduler_and_runner(runner_setup, monkeypatch, path)
    finally:
        gaudi.lazy = False
    _, runner = _scheduler_and_runner(runner_setup, monkeypatch, path)
    hooks = runner.unified_hooks[0]
    assert in_parts(hooks.bucket_plan) and hooks.graph_backend is None  # enforce_eager: no compiled model
    hooks.graph_backend = "eager"
    names = {f"model.layers.{i}.self_attn.attn" for i in range(2)}
    metadata = runner.plan_step(HpuStep(["a", "b", "c", "d"], q, c, [table]))
    assert set(metadata) == names and len({id(m) for m in metadata.values()}) == 1
    md = metadata["model.layers.0.self_attn.attn"]
    assert md.parts is not None and md.parts.buckets[0] in plan.prompt_graphs and md.graph_backend == "eager"
    assert md.rows == model_rows(hooks.bucket_plan, 43) == 64 and md.logits_rows(4).tolist() == [0, 40, 41, 42]
    assert md.slot_mapping[:43].tolist() == [int(table[r, p // C_BLOCK]) * C_BLOCK + p % C_BLOCK
                                            for r in range(4) for p in range(c[r], c[r] + q[r])]
    assert (md.slot_mapping[43:] == runner._PAD_SLOT_ID).all()
    decodes = HpuStep(["a", "c"], q[[0, 2]], c[[0, 2]], [table[[0, 2]]])
    whole = runner.plan_step(decodes)["model.layers.1.self_attn.attn"]
    assert whole.parts is None and whole.graph_backend == "eager" and whole.rows == whole.batch.bucket.query_len
    seen = []
    monkeypatch.setattr(runner, "_execute_model_generic", lambda tokens, positions, md, *a, **k: seen.append(
        (tokens.shape[1], next(iter(md.values())))) or (None, None, None, None))
    for bucket in plan.buckets[:2] + plan.prompt_graphs:
        runner._warm_bucket(bucket, None)
    for bucket, (rows, md) in zip(plan.buckets[:2] + plan.prompt_graphs, seen):
        assert md.graph_backend == "eager" and md.rows == rows
        if bucket in plan.prompt_graphs:
            assert md.parts.buckets == (bucket,) and rows == model_rows(plan, md.parts.num_tokens)
        else:
            assert md.parts is None and rows == bucket.query_len


def test_auto_in_the_runner_is_a_plan_in_parts_in_torch_compile_mode_and_whole_in_lazy_mode(
        runner_setup, gaudi, monkeypatch, tmp_path):  # noqa: F811
    """`VLLM_GAUDI_UNIFIED_BUCKETS=auto` through the unified runner's start-up (`make_unified_hooks`,
    `parts_support`): in torch.compile mode `auto` asks for a plan in parts, and the runner plans a step of a
    prompt and decodes in parts with it; in lazy mode a whole plan, its steps whole. (`make_plan` stands in for
    `buckets generate`: the exponential buckets of the server's settings, and with `--parts` grid graphs.)"""
    from test_vllm_gaudi import C_BLOCK, _scheduler_and_runner

    from vllm_gaudi_unified.vllm_plugin import auto_plan as auto
    from vllm_gaudi_unified.vllm_plugin.hpu_step import HpuStep

    q, c = np.array([1, 40, 1, 1]), np.array([70, 0, 33, 100])
    table = np.zeros((4, 8), np.int64)
    table[:, :5] = np.arange(1, 21).reshape(4, 5)
    blocks = [list(map(int, row[:-(-(a + b) // C_BLOCK)])) for row, a, b in zip(table, q, c)]
    asked = []

    def make(settings, spec, path, parts=False):
        asked.append(parts)
        plan = exponential_plan(settings, spec)
        if parts:
            grids, _ = learn_grid_graphs(plan, [TraceStep(C_BLOCK, q, c, blocks)], 2)
            plan = replace(plan, prompt_graphs=grids, info={**plan.info, "parts": True})
        plan.save(path)

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(auto, "make_plan", make)
    for lazy in (False, True):
        gaudi.lazy = lazy
        try:
            _, runner = _scheduler_and_runner(runner_setup, monkeypatch, "auto")
        finally:
            gaudi.lazy = False
        hooks = runner.unified_hooks[0]
        assert asked[-1] == (not lazy) == in_parts(hooks.bucket_plan) == hooks.steps_in_parts
        md = runner.plan_step(HpuStep(["a", "b", "c", "d"], q, c, [table]))["model.layers.0.self_attn.attn"]
        assert (md.parts is not None) == (not lazy) and md.logits_rows(4).tolist() == [0, 40, 41, 42]
    assert asked == [True, False]


@pytest.mark.slow
def test_generation_with_a_plan_in_parts_through_the_unified_runner(tmp_path):
    """The e2e scenario through vllm-gaudi's worker and the unified runner (`test_vllm_gaudi.py`, d.) with a plan
    in parts learned from the unpadded run's recorded steps (the exponential buckets, grid graphs of its grids):
    accepted at start-up (the stand-in's mode is torch.compile mode; `enforce_eager`, so the parts run eagerly),
    every bucket and grid graph warmed through the model, steps with prompts run in parts, and the tokens and
    logprobs are vLLM's own CPU attention's."""
    import re

    import vllm_helpers as H
    from test_vllm_gaudi import LOGPROB_ATOL, _engine

    from vllm_gaudi_unified.bucket_plans.trace import read_trace

    model = H.make_tiny_llama(str(tmp_path / "model"), **H.MODELS["gqa"])
    path, trace = str(tmp_path / "parts.json"), str(tmp_path / "trace.jsonl")

    def unified_then_parts() -> dict:
        _engine(model, str(tmp_path / "unified.json"), gaudi=True, VLLM_GAUDI_UNIFIED_RECORD_TRACE=trace)
        settings = ServerSettings(block_size=H.BLOCK_SIZE, max_num_seqs=H.MAX_NUM_SEQS,
                                  max_num_batched_tokens=H.MAX_NUM_BATCHED_TOKENS, max_model_len=H.MAX_MODEL_LEN,
                                  num_blocks=256)
        tiled = exponential_plan(settings, base=8.0)  # few buckets: each is a model forward at start-up
        grids, _ = learn_grid_graphs(tiled, read_trace(trace).steps, 8)
        plan = replace(tiled, prompt_graphs=grids, info={**tiled.info, "parts": True})
        plan.save(path)
        return dict(_engine(model, str(tmp_path / "parts_run.json"), gaudi=True, VLLM_GAUDI_UNIFIED_BUCKETS=path,
                            VLLM_LOGGING_LEVEL="DEBUG"), num_graphs=len(plan.buckets) + len(grids))

    got, ref = H.concurrently(unified_then_parts, lambda: _engine(model, str(tmp_path / "ref.json"), gaudi=False))
    log = got["log"]
    assert f"warmed {got['num_graphs']} buckets through the model" in log
    assert len(re.findall(r"unified attention step in parts: graphs", log)) > 0, "no step ran in parts"
    random_cases = {r["name"] for wave in H.scenario_prompts() for r in wave if r.get("n", 1) > 1}
    for case, r in H.compare_results(got, ref).items():
        if case not in random_cases:  # (n > 1 draws in vllm-gaudi's batch order: `test_vllm_gaudi.py` compares them)
            assert r["tokens_identical"], (case, r)
            assert r["max_abs_logprob_diff"] <= LOGPROB_ATOL, (case, r)
