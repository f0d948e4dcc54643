"""One-token prompts and one-token chunks beside longer prompts, MLA through the unified runner on Gaudi.

A tiny DeepSeek-V2 (hidden 128, kv_lora_rank 512 + rope 64) with blocks of 32, a 64-token budget, chunked
prefill and prefix caching, as a new user would start it: vllm-gaudi's `03.hpu_custom_models` plugin left out
and its DeepSeek forward not imported by the test (`vllm_model_helpers.py mla --scenario short`). The first
step holds prompts of 1, 17 and 45 tokens and the first 1-token chunk of a 74-token prompt; it crashed in
vLLM's DeepSeek forward (`torch.cat` of 2-D and 3-D tensors, its tensor-parallel all-gather branch, which
reads the `[1, T]` positions' first size as the token count) until the runner loaded vllm-gaudi's fix of that
forward itself (`vllm_plugin/hpu_models.py`). Against vLLM's own CPU_MLA (torch rotary: its CPU kernel is
wrong for DeepSeek's strided query), unpadded and padded to a bucket plan warmed through the model.
"""
from __future__ import annotations

import pytest

from test_vllm_gaudi import GAUDI_PLUGINS, gaudi  # noqa: F401 (also: the module's skips)
from test_vllm_gaudi_mla import LOGPROB_ATOL, _mla_engine

pytestmark = pytest.mark.vllm

BLOCK = 32
SHORT = ("--scenario", "short")


@pytest.fixture(scope="module")
def short_runs(tmp_path_factory):
    from dataclasses import replace

    import vllm_helpers as H
    import vllm_model_helpers as M
    from vllm_gaudi_unified.bucket_plans.exponential import exponential_plan
    from vllm_gaudi_unified.bucket_plans.prompt_graphs import learn_prompt_graphs
    from vllm_gaudi_unified.bucket_plans.settings import ServerSettings
    from vllm_gaudi_unified.bucket_plans.trace import read_trace

    root = tmp_path_factory.mktemp("mla_short")
    model = M.make_tiny_deepseek(str(root / "ds"), hidden=128)
    gaudi = (*SHORT, "--block-size", str(BLOCK))
    trace = str(root / "trace.jsonl")
    plan = exponential_plan(ServerSettings(block_size=BLOCK, max_num_seqs=8, max_num_batched_tokens=64,
                                           max_model_len=H.MAX_MODEL_LEN, num_blocks=128), base=8.0)

    def unified_then_buckets() -> tuple[dict, list]:
        nonlocal plan
        runs = {"unified": _mla_engine(model, str(root / "unified.json"), gaudi=True, extra=gaudi,
                                       VLLM_GAUDI_UNIFIED_RECORD_TRACE=trace, VLLM_LOGGING_LEVEL="DEBUG")}
        steps = read_trace(trace).steps
        graphs, _ = learn_prompt_graphs(plan, steps, max_graphs=4)
        plan = replace(plan, prompt_graphs=graphs)
        plan.save(str(root / "plan.json"))
        runs["unified_buckets"] = _mla_engine(model, str(root / "buckets.json"), gaudi=True, extra=gaudi,
                                              VLLM_GAUDI_UNIFIED_BUCKETS=str(root / "plan.json"),
                                              VLLM_LOGGING_LEVEL="DEBUG")
        return runs, steps

    (runs, steps), ref = H.concurrently(unified_then_buckets,
                                        lambda: _mla_engine(model, str(root / "ref.json"), gaudi=False, extra=SHORT))
    return dict(runs, ref=ref), steps, len(plan.buckets) + len(plan.prompt_graphs)


@pytest.mark.slow
def test_the_steps_hold_one_token_prompts_and_chunks(short_runs):
    """The recorded steps are the ones described: the first one 1 + 17 + 45 new tokens and a 1-token chunk of
    the 74-token prompt; a 1-token chunk over 64 cached tokens (a prefix-cache hit) beside a 1-token prompt."""
    _, steps, _ = short_runs
    first = steps[0]
    assert first.block_size == BLOCK
    assert first.query_lens.tolist() == [1, 17, 45, 1] and first.context_lens.tolist() == [0, 0, 0, 0]
    hit = [s for s in steps if 64 in s.context_lens[s.query_lens == 1].tolist() and (s.context_lens == 0).any()]
    assert hit, "no step computed one token over 64 cached ones beside a new prompt"


@pytest.mark.slow
@pytest.mark.parametrize("run", ["unified", "unified_buckets"])
def test_one_token_prompts_and_chunks_match_vllm_cpu_mla(short_runs, run):
    """Every request's tokens identical to vLLM's CPU_MLA, logprobs (sampled and prompt) within 1e-4; the
    runner loaded vllm-gaudi's DeepSeek forward (`hpu_models.py`) and ran prompt steps expanded."""
    import vllm_helpers as H

    runs, _, warmed = short_runs
    ref, ref_log = runs["ref"]
    got, log = runs[run]
    assert "Using CPU_MLA backend" in ref_log
    assert "Using the unified attention backend GAUDI_UNIFIED_HPU_MLA" in log
    assert "loaded vllm-gaudi's model fixes for [1, T] inputs: vllm_gaudi.models.deepseek_v2" in log
    assert "unified MLA on Gaudi: prompt rows in the expanded form" in log
    assert got["block_size"] == BLOCK and got["chunked_prefill"] and got["prefix_caching"]
    if run == "unified_buckets":
        assert f"warmed {warmed} buckets through the model" in log
    worst = H.same_tokens_worst_logprob(got, ref, cases=7)
    assert worst <= LOGPROB_ATOL, worst
    print(run, "one-token prompts/chunks: max |dlogprob| vs vLLM CPU_MLA", worst)


def test_shape_fixes_follow_the_model_module(gaudi):
    """vllm-gaudi's DeepSeek fix is loaded for every architecture of vLLM's DeepSeek module and for no other
    model; once loaded, vLLM's DeepSeek model runs vllm-gaudi's forward."""
    from types import SimpleNamespace

    from vllm.model_executor.models import deepseek_v2

    from vllm_gaudi_unified.vllm_plugin.hpu_models import load_shape_fixes

    assert load_shape_fixes(SimpleNamespace(architectures=["LlamaForCausalLM", "Qwen3ForCausalLM"])) == []
    for arch in ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"):
        assert load_shape_fixes(SimpleNamespace(architectures=[arch])) == ["vllm_gaudi.models.deepseek_v2"]
    assert deepseek_v2.DeepseekV2Model.forward.__module__ == "vllm_gaudi.models.deepseek_v2"
