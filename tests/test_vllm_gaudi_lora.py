"""LoRA adapters through vllm-gaudi's runner with unified attention, on the CPU (habana stand-in).

vllm-gaudi applies adapters through a per-row mask (`LoraMask`, read by its `PunicaWrapperHPU`);
the unified runner builds it per token of the flat step (`vllm_plugin/hpu_lora.py`). Checked here:
the mask arithmetic (fast), and a whole generation (slow): a tiny Llama with two random rank-8
adapters written offline (`vllm_lora.py`), requests with adapter a, adapter b and none sharing
steps, prompts chunked by the 64-token budget, steps unpadded and padded to the buckets of a warmed plan,
against vLLM's CPU attention with the same LoRA requests: identical tokens, |d logprob| <= 1e-4; and the
adapters change the tokens. Prompt logprobs under LoRA (which vLLM 0.32's CPU runner cannot compute) against
the first generated token of the prompt cut short.
"""
from __future__ import annotations

import json
import os
import sys
from functools import partial

import numpy as np
import pytest
import torch

from test_vllm_gaudi import LOGPROB_ATOL, _run_engine, _warmable_plan, gaudi  # noqa: F401, I001 (also: the module's skips)
import vllm_helpers as H
import vllm_lora as L

pytestmark = pytest.mark.vllm

LORA_HELPER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_lora.py")


# ---------------------------------------------------------------------------------------- the mask

def test_token_adapter_ids_pad_with_no_adapter(gaudi):  # noqa: F811
    from vllm_gaudi_unified.vllm_plugin.hpu_lora import NO_ADAPTER, token_adapter_ids

    got = token_adapter_ids(np.array([3, 0, 7]), np.array([2, 1, 3]), 8)
    assert got.tolist() == [3, 3, 0, 7, 7, 7, NO_ADAPTER, NO_ADAPTER]
    with pytest.raises(ValueError, match="padded=5 rows hold fewer than the step's 6 tokens"):
        token_adapter_ids(np.array([3, 0, 7]), np.array([2, 1, 3]), 5)


def test_flat_mask_applies_each_tokens_adapter(gaudi):  # noqa: F811
    """vllm-gaudi's own LoRA arithmetic (`dispatch_bgmv_linear`) over the flat mask gives, row by row,
    x + scale * B_a A_a x for the token's adapter a (none on padding), float64."""
    from vllm_gaudi.extension.ops import LoraMask, dispatch_bgmv_linear

    from vllm_gaudi_unified.vllm_plugin.hpu_lora import adapter_mask, token_adapter_ids

    rng = torch.Generator().manual_seed(0)
    max_loras, rank, h_in, h_out = 3, 4, 16, 12
    wa = torch.randn(max_loras, 1, rank, h_in, generator=rng, dtype=torch.float64)
    wb = torch.randn(max_loras, 1, h_out, rank, generator=rng, dtype=torch.float64)
    index_to_id = [11, None, 5]  # adapter 11 in slot 0, adapter 5 in slot 2
    per_token = token_adapter_ids(np.array([5, 0, 11, 5]), np.array([3, 2, 1, 4]), 13)
    x = torch.randn(13, h_in, generator=rng, dtype=torch.float64)
    y = torch.zeros(13, h_out, dtype=torch.float64)
    LoraMask.setLoraMask(adapter_mask(per_token, index_to_id, max_loras, rank, torch.float64))
    try:
        dispatch_bgmv_linear(y, x, wa, wb, 0, 0.5)
    finally:
        LoraMask.setLoraMask(None)
    slot = {11: 0, 5: 2}
    want = torch.stack([0.5 * wb[slot[i], 0] @ (wa[slot[i], 0] @ x[t]) if i else torch.zeros(h_out, dtype=x.dtype)
                        for t, i in enumerate(per_token.tolist())])
    torch.testing.assert_close(y, want, rtol=0, atol=1e-12)
    assert per_token[10:].tolist() == [0, 0, 0] and not y[10:].any()


def test_mask_refuses_an_adapter_not_in_a_slot(gaudi):  # noqa: F811
    from vllm_gaudi_unified.vllm_plugin.hpu_lora import adapter_mask

    with pytest.raises(RuntimeError, match=r"LoRA adapter ids \[9\] are not in a slot"):
        adapter_mask(np.array([9, 0]), [1, None], 2, 8, torch.float32)


# ---------------------------------------------------------------------------------------- e2e

@pytest.mark.slow
def test_lora_through_the_unified_runner(tmp_path):
    model = H.make_tiny_llama(str(tmp_path / "model"), **H.MODELS["gqa"])
    a = L.make_adapter(str(tmp_path / "lora_a"), model, seed=1)
    b = L.make_adapter(str(tmp_path / "lora_b"), model, seed=2)
    plan, trace = str(tmp_path / "plan.json"), str(tmp_path / "trace.jsonl")
    num_buckets = _warmable_plan(plan)

    def run(name: str, gaudi_path: bool, env: dict, extra: list) -> dict:
        out = str(tmp_path / f"{name}.json")
        return _run_engine([sys.executable, LORA_HELPER, model, a, b, out, *extra], out, gaudi_path, **env)

    configs = {"buckets": (True, dict(VLLM_GAUDI_UNIFIED_BUCKETS=plan), []),
               "ref": (False, {}, []), "unified": (True, dict(VLLM_GAUDI_UNIFIED_RECORD_TRACE=trace), []),
               "prompt_logprobs": (True, {}, ["--prompt-logprobs"])}
    runs = dict(zip(configs, H.concurrently(*(partial(run, name, *how) for name, how in configs.items()))))
    ref = runs["ref"]
    # Padded to warmed buckets: the padding rows carry no adapter (and the warm-up forwards none).
    assert f"warmed {num_buckets} buckets through the model" in runs["buckets"]["log"]
    worst = 0.0
    for run in ("unified", "buckets", "prompt_logprobs"):
        assert "Using the unified attention backend GAUDI_UNIFIED_HPU_ATTN" in runs[run]["log"]
        for case, r in H.compare_results(runs[run], ref).items():
            assert r["tokens_identical"], (run, case, r)
            assert r["max_abs_logprob_diff"] <= LOGPROB_ATOL, (run, case, r)
            worst = max(worst, r["max_abs_logprob_diff"])
    with open(trace) as f:
        steps = [json.loads(line) for line in f if '"query_lens"' in line]
    assert any(len(s["query_lens"]) > 1 and any(c > 0 for c in s["context_lens"]) for s in steps)  # chunks mixed
    # The adapters matter: for every prompt, adapter a, adapter b and none give three different generations.
    tokens = {case: res["samples"][0]["tokens"] for case, res in ref["results"].items()}
    for p in {c.rsplit("_", 1)[0] for c in tokens if "pre" not in c}:
        assert len({tuple(tokens[f"{p}_{x}"]) for x in ("none", "a", "b")}) == 3, p
    # Prompt logprobs under LoRA: vLLM 0.32's CPU runner cannot compute them (its `_get_prompt_logprobs_dict`
    # runs the LoRA logits over a prompt's rows with the step's per-request sampler indices: an einsum size
    # error in `bgmv_shrink`), so the reference is the same prompt cut short: the top prompt logprob at
    # position k is the first generated token of the prompt's first k tokens (same token, same logprob).
    for x in ("none", "a", "b"):
        entries = runs["prompt_logprobs"]["results"][f"p70_{x}"]["prompt_logprobs"]
        assert len(entries) == 70 and entries[0] is None, x
        for k in L.PREFIXES:
            first = ref["results"][f"p70pre{k}_{x}"]["samples"][0]
            token = str(first["tokens"][0])
            assert token in entries[k], (x, k, token, entries[k])  # the top-1 next token
            diff = abs(entries[k][token] - first["logprobs"][0][token])
            assert diff <= LOGPROB_ATOL, (x, k, diff)
            worst = max(worst, diff)
    print("LoRA: max |dlogprob| vs vLLM CPU attention", worst)
