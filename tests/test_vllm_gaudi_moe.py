"""MoE models through vllm-gaudi's runner with unified attention, on the CPU.

vllm-gaudi's fused-MoE layer (its ops plugin) failed beside vLLM 0.32 on every MoE model: its router factory
lacks keywords vLLM 0.32 passes (`skip_padding`, ...: a TypeError while building the model), its fast MoE
forward calls a runner method 0.32 lacks, and its grouped routing imports `select_experts` from where 0.32 no
longer has it. The unified runner bridges the three (`vllm_plugin/hpu_moe.py`); the experts still run through
vllm-gaudi's MoE method and Gaudi's fused kernel (`torch.ops.hpu.mixture_of_experts`, as torch arithmetic in
the stand-in: `habana_moe.py`). Tiny Mixtral and Qwen3-MoE models (softmax top-k routing) run the e2e scenario
(`vllm_helpers.run_scenario`: chunked prefill, prefix caching, mixed steps, prompt logprobs, n > 1), a tiny
DeepSeek-V2 with experts (MLA, grouped top-k routing without renormalizing, a shared expert) the one-token
steps of `vllm_model_helpers.short_prompts` (blocks of 32); each against vLLM's own CPU platform (its CPU MoE;
CPU_MLA for DeepSeek), unpadded and (Mixtral, DeepSeek) padded to a bucket plan warmed through the model.
"""
from __future__ import annotations

import re
from functools import partial

import pytest
import torch

from test_vllm_gaudi import LOGPROB_ATOL, _engine, _warmable_plan, gaudi  # noqa: F401, I001 (also: the module's skips)
from test_vllm_gaudi_mla import _mla_engine
from test_vllm_gaudi_models import assert_same_as_reference
import vllm_helpers as H
import vllm_models as M

pytestmark = pytest.mark.vllm

ADAPTED = ("vllm-gaudi's MoE layer adapted to this vLLM: router keyword skip_padding; router keyword bias_vl; "
           "router keyword image_sentinel_lo; vLLM's MoERunner.forward (no _maybe_sync_shared_experts_stream); "
           "select_experts from router.cpu_router")
DEEPSEEK = "deepseek_v2_moe"
SHORT = ("--scenario", "short")


def _deepseek_engine(model: str, out: str, gaudi: bool, **env) -> dict:
    """`vllm_model_helpers.py mla --scenario short` (blocks of 32 on Gaudi): its result, with its log."""
    result, log = _mla_engine(model, out, gaudi, (*SHORT, "--block-size", "32") if gaudi else SHORT, **env)
    return dict(result, log=log)


@pytest.fixture(scope="module")
def moe_runs(tmp_path_factory):
    import vllm_model_helpers as MH

    root = tmp_path_factory.mktemp("moe")
    models = {name: M.make_moe_model(name, str(root / name)) for name in M.MOE_MODELS}
    models[DEEPSEEK] = MH.make_tiny_deepseek(str(root / DEEPSEEK), hidden=128, experts=True)
    plans = {}

    def gaudi_runs(name: str) -> dict:
        engine, model = _deepseek_engine if name == DEEPSEEK else _engine, models[name]
        trace = str(root / f"{name}.jsonl")
        runs = {"unified": engine(model, str(root / f"{name}_unified.json"), gaudi=True,
                                  VLLM_GAUDI_UNIFIED_RECORD_TRACE=trace)}
        if name != "qwen3_moe":  # every step padded to a bucket of a plan, with the prompt graphs of the run's steps
            plan = str(root / f"{name}_plan.json")
            plans[name] = _warmable_plan(plan, trace=trace)
            runs["buckets"] = engine(model, str(root / f"{name}_buckets.json"), gaudi=True,
                                     VLLM_GAUDI_UNIFIED_BUCKETS=plan, VLLM_LOGGING_LEVEL="DEBUG")
        return runs

    def reference(name: str) -> dict:
        engine = _deepseek_engine if name == DEEPSEEK else _engine
        return {"ref": engine(models[name], str(root / f"{name}_ref.json"), gaudi=False)}

    jobs = [partial(gaudi_runs, name) for name in models] + [partial(reference, name) for name in models]
    runs = {name: {} for name in models}
    for name, result in zip([*models, *models], H.concurrently(*jobs)):
        runs[name].update(result)
    return runs, plans


@pytest.mark.slow
@pytest.mark.parametrize("name", [*M.MOE_MODELS, DEEPSEEK])
def test_moe_models_through_the_unified_runner(moe_runs, name):
    """Same tokens as vLLM's CPU platform, logprobs within `LOGPROB_ATOL`; Mixtral and DeepSeek also with every
    step padded to a bucket of a plan whose buckets all ran through the model at start-up."""
    runs, plans = moe_runs
    got, ref = runs[name]["unified"], runs[name]["ref"]
    backend = "GAUDI_UNIFIED_HPU_MLA" if name == DEEPSEEK else "GAUDI_UNIFIED_HPU_ATTN"
    assert f"Using the unified attention backend {backend}" in got["log"]
    assert ADAPTED in got["log"]
    worst = assert_same_as_reference(got, ref)
    if name in plans:
        padded = runs[name]["buckets"]
        assert f"warmed {plans[name]} buckets through the model" in padded["log"]
        assert re.search(r"unified attention step: phase \S+, bucket \S+, step shape", padded["log"])
        worst = max(worst, assert_same_as_reference(padded, ref))
    assert worst <= LOGPROB_ATOL
    print(name, "max |dlogprob| vs vLLM's CPU platform", worst)


# ---------------------------------------------------------------------------------------- the bridges

@pytest.fixture
def gaudi_moe(gaudi, monkeypatch):
    """vllm-gaudi's `hpu_fused_moe` module and vLLM's own router factory; what the module's import replaces in vLLM
    is put back afterwards."""
    from vllm.model_executor.layers.fused_moe import layer
    from vllm.model_executor.layers.fused_moe.router import router_factory
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    vllm_factory = router_factory.create_fused_moe_router
    assert vllm_factory.__module__ == router_factory.__name__, "vllm-gaudi's MoE ops were imported before"
    for owner, attr in ((layer, "create_fused_moe_router"), (router_factory, "create_fused_moe_router"),
                        (layer, "get_compressed_expert_map"), (MoERunner, "forward")):
        monkeypatch.setattr(owner, attr, getattr(owner, attr, None), raising=False)  # absent: deleted afterwards
    import vllm_gaudi.ops.hpu_fused_moe as module

    monkeypatch.setattr(module, "_MOE_COMPILE", module._MOE_COMPILE)
    return module, vllm_factory


VLLM_032_ROUTER_KEYWORDS = dict(  # what vLLM 0.32's FusedMoEFactory passes for a Mixtral layer
    top_k=2, global_num_experts=8, eplb_state=None, renormalize=True, use_grouped_topk=False, num_expert_group=None,
    topk_group=None, custom_routing_function=None, scoring_func="softmax", routed_scaling_factor=1.0,
    e_score_correction_bias=None, num_fused_shared_experts=0, skip_padding=False, shared_expert_weight=1.0,
    zero_expert_type=None, num_logical_experts=8, hash_indices_table=None, bias_vl=None, image_sentinel_lo=0)


def test_router_factory_takes_vllm_keywords_and_refuses_what_it_cannot_serve(gaudi_moe):
    """vllm-gaudi's factory, as vLLM 0.32 calls it: a TypeError unadapted; adapted, the keywords at their neutral
    values are dropped (softmax top-k and grouped top-k routers built), others refused naming keyword and value.
    vLLM's own factory takes them all and is left as it is."""
    from vllm_gaudi_unified.vllm_plugin.hpu_moe import adapt_router_factory

    module, vllm_factory = gaudi_moe
    factory = module.create_fused_moe_router
    with pytest.raises(TypeError, match="skip_padding"):
        factory(**VLLM_032_ROUTER_KEYWORDS)
    adapted = adapt_router_factory(factory)
    assert adapted.adapted_keywords == ("skip_padding", "bias_vl", "image_sentinel_lo")
    assert type(adapted(**VLLM_032_ROUTER_KEYWORDS)).__name__ == "FusedTopKRouter"
    grouped = dict(VLLM_032_ROUTER_KEYWORDS, use_grouped_topk=True, num_expert_group=4, topk_group=2)
    assert type(adapted(**grouped)).__name__ == "GroupedTopKRouter"
    for key, value in (("skip_padding", True), ("bias_vl", torch.zeros(8)), ("image_sentinel_lo", 5)):
        with pytest.raises(NotImplementedError, match=f"MoE routing with {key}=.*vllm-gaudi's router factory"):
            adapted(**dict(VLLM_032_ROUTER_KEYWORDS, **{key: value}))
    assert adapt_router_factory(vllm_factory) is vllm_factory


def test_fast_moe_forward_is_off_only_where_vllm_lacks_its_calls(gaudi_moe):
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    from vllm_gaudi_unified.vllm_plugin.hpu_moe import keep_vllm_moe_forward

    module, _ = gaudi_moe
    assert module._MOE_COMPILE  # vllm-gaudi's default (HPU_FUSED_MOE=1)

    class NewerRunner(MoERunner):
        def _maybe_sync_shared_experts_stream(self, shared_experts_input):
            pass

    assert keep_vllm_moe_forward(NewerRunner, module) == [] and module._MOE_COMPILE
    assert keep_vllm_moe_forward(MoERunner, module) == ["_maybe_sync_shared_experts_stream"]
    assert not module._MOE_COMPILE


def test_select_experts_where_vllm_gaudi_imports_it(gaudi_moe):
    """vllm-gaudi's grouped routing imports `select_experts` from vLLM's `experts.cpu_moe`: an ImportError in vLLM
    0.32, which has it in `router.cpu_router`; bridged, DeepSeek-V3-style grouped routing runs through it."""
    from types import SimpleNamespace

    from vllm.model_executor.layers.fused_moe.experts import cpu_moe
    from vllm.model_executor.layers.fused_moe.router import cpu_router

    from vllm_gaudi_unified.vllm_plugin.hpu_moe import bridge_select_experts

    module, _ = gaudi_moe
    layer = SimpleNamespace(moe_config=SimpleNamespace(num_logical_experts=8), top_k=2, use_grouped_topk=True,
                            renormalize=True, topk_group=2, num_expert_group=4, custom_routing_function=None,
                            scoring_func="sigmoid", routed_scaling_factor=2.5, e_score_correction_bias=torch.zeros(8))
    x, logits = torch.randn(5, 16), torch.randn(5, 8)
    assert not hasattr(cpu_moe, "select_experts")  # vLLM 0.32
    with pytest.raises(ImportError, match="select_experts"):
        module.select_experts_from_routed(layer, x, logits)
    try:
        assert bridge_select_experts(cpu_moe, cpu_router) and bridge_select_experts(cpu_moe, cpu_router)
        weights, ids = module.select_experts_from_routed(layer, x, logits)
    finally:
        del cpu_moe.select_experts, cpu_moe.select_experts_bridged
    assert ids.shape == (5, 2) and torch.allclose(weights.sum(-1), torch.full((5,), 2.5))  # renormalized, scaled
    assert not bridge_select_experts(SimpleNamespace(), SimpleNamespace())  # a layout with neither: left alone
    both = SimpleNamespace(select_experts=cpu_router.select_experts)  # a vLLM that has it in both: not reported
    assert not bridge_select_experts(both, cpu_router) and not hasattr(both, "select_experts_bridged")


# ---------------------------------------------------------------------------------------- the stand-in's kernel

def test_standin_moe_kernel_against_per_token_experts(gaudi):
    """`torch.ops.hpu.mixture_of_experts` of the stand-in, against each token's routes summed one by one
    (silu(gate) * up, then down); as one expert-parallel rank holding experts 2..4 only."""
    g = torch.Generator().manual_seed(0)
    tokens, hidden, inter, experts, k = 37, 16, 8, 6, 2
    x = torch.randn(tokens, hidden, generator=g, dtype=torch.float64)
    w12 = [torch.randn(2 * inter, hidden, generator=g, dtype=torch.float64) for _ in range(experts)]
    w3 = [torch.randn(hidden, inter, generator=g, dtype=torch.float64) for _ in range(experts)]
    ids = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])
    weights = torch.rand(tokens, k, generator=g, dtype=torch.float64)

    def expected(lo, hi):
        out = torch.zeros_like(x)
        for t in range(tokens):
            for j in range(k):
                e = int(ids[t, j])
                if lo <= e <= hi:
                    h = w12[e] @ x[t]
                    out[t] += weights[t, j] * (w3[e] @ (torch.nn.functional.silu(h[:inter]) * h[inter:]))
        return out

    got = torch.ops.hpu.mixture_of_experts(hidden_states=x, expert_routing_table=ids, router_weights=weights,
                                           w12=w12, w3=w3, permuted_weights=True, activation="silu", experts_min=0,
                                           experts_max=experts - 1)
    torch.testing.assert_close(got, expected(0, experts - 1), rtol=0, atol=1e-10)
    rank = torch.ops.hpu.mixture_of_experts(hidden_states=x, expert_routing_table=ids, router_weights=weights,
                                            w12=w12[2:5], w3=w3[2:5], permuted_weights=True, activation="silu",
                                            experts_min=2, experts_max=4)
    torch.testing.assert_close(rank, expected(2, 4), rtol=0, atol=1e-10)
