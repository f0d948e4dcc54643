"""Models with several attention kinds through vllm-gaudi's runner with unified attention, on the CPU.

vllm-gaudi puts every decoder layer in one KV cache group (one block table) and narrows the blocks
per layer; the unified runner plans the step once per attention kind (`hpu_kinds.py`). Each tiny
model of `vllm_models.py` (Gemma 2 and 3: interleaved window 16 / full, Gemma 2's soft-caps;
gpt-oss-like: sinks + alternating window 16, dense MLP; Llama-4-like: chunked local attention in
chunks of 32 + a global NoPE layer, dense MLP) runs the e2e scenario (`vllm_helpers.run_scenario`:
chunked prefill, prefix caching, mixed steps, prompt logprobs, n > 1) through vllm-gaudi's platform,
worker, model adapter and sampling on the habana stand-in, against vLLM's own CPU attention (which
serves the same models with its hybrid KV cache manager: one group per window, virtual batches for
the chunks). The same weights with every layer full attention show that the window / the chunking
change the result.
"""
from __future__ import annotations

import os
import re
from functools import partial

import pytest

from test_vllm_gaudi import LOGPROB_ATOL, _engine, _warmable_plan, gaudi  # noqa: F401, I001 (also: the module's skips)
import vllm_helpers as H
import vllm_models as M

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def model_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("kinds")
    plan, trace = str(root / "plan.json"), str(root / "llama4_trace.jsonl")

    def llama4_unified_then_buckets(model: str) -> dict:
        # The plan takes the prompt graphs of the unpadded run's steps: several kinds replanned per graph.
        unified = _engine(model, str(root / "llama4_like_unified.json"), gaudi=True,
                          VLLM_GAUDI_UNIFIED_RECORD_TRACE=trace)
        num_buckets = _warmable_plan(plan, trace=trace)
        return {"unified": unified, "buckets": dict(_engine(model, str(root / "llama4_buckets.json"), gaudi=True,
                                                            VLLM_GAUDI_UNIFIED_BUCKETS=plan,
                                                            VLLM_LOGGING_LEVEL="DEBUG"), num_buckets=num_buckets)}

    keys, jobs = [], []
    for name in reversed(M.MODELS):  # llama4_like first: its bucketed run waits for its unpadded one
        local = M.make_model(name, str(root / name))
        full = M.make_model(name, str(root / (name + "_full")), local=False)
        if name == "llama4_like":
            keys.append((name, None))
            jobs.append(partial(llama4_unified_then_buckets, local))
        else:
            keys.append((name, "unified"))
            jobs.append(partial(_engine, local, str(root / f"{name}_unified.json"), gaudi=True))
        keys += [(name, "ref"), (name, "full_ref")]
        jobs += [partial(_engine, local, str(root / f"{name}_ref.json"), gaudi=False),
                 partial(_engine, full, str(root / f"{name}_full_ref.json"), gaudi=False)]
    runs = {name: {} for name in M.MODELS}
    for (name, run), result in zip(keys, H.concurrently(*jobs)):
        runs[name].update(result if run is None else {run: result})
    return runs


RANDOM_CASES = {r["name"] for wave in H.scenario_prompts() for r in wave if r.get("n", 1) > 1}
KINDS_LOG = {"gemma2": "full: 2 layers, sliding window 16: 2 layers", "gemma3": "full: 2 layers, sliding window 16: 2 layers",
             "gptoss_like": "full: 2 layers, sliding window 16: 2 layers",
             "llama4_like": "full: 1 layers, chunked local (32): 3 layers"}


def assert_same_as_reference(got: dict, ref: dict) -> float:
    """Greedy cases: identical tokens, logprobs within 1e-4; n > 1 (random draws in vllm-gaudi's batch order,
    see test_vllm_gaudi.test_generation_through_the_unified_runner): the first token's top logprobs.
    Returns the largest |logprob difference|."""
    worst = 0.0
    for case, r in H.compare_results(got, ref).items():
        if case in RANDOM_CASES:
            for a, b in zip(got["results"][case]["samples"], ref["results"][case]["samples"]):
                common = a["logprobs"][0].keys() & b["logprobs"][0].keys()
                assert len(common) >= 2, case
                diff = max(abs(a["logprobs"][0][t] - b["logprobs"][0][t]) for t in common)
                assert diff <= LOGPROB_ATOL, (case, diff)
                worst = max(worst, diff)
            continue
        assert r["tokens_identical"], (case, r)
        assert r["max_abs_logprob_diff"] <= LOGPROB_ATOL, (case, r)
        worst = max(worst, r["max_abs_logprob_diff"])
    return worst


def _tokens(run: dict, case: str) -> list:
    return [s["tokens"] for s in run["results"][case]["samples"]]


@pytest.mark.slow
@pytest.mark.parametrize("name", M.MODELS)
def test_attention_kinds_through_the_unified_runner(model_runs, name):
    runs = model_runs[name]
    got, ref = runs["unified"], runs["ref"]
    assert "Using the unified attention backend GAUDI_UNIFIED_HPU_ATTN" in got["log"]
    assert f"one plan per attention kind per step ({KINDS_LOG[name]})" in got["log"]
    worst = assert_same_as_reference(got, ref)
    # The window / the chunking matter: the same weights with full attention everywhere generate other
    # tokens in some greedy case (their top logprobs may not even share a token, so no difference is taken).
    greedy = [c for c in ref["results"] if c not in RANDOM_CASES]
    changed = [c for c in greedy if _tokens(runs["full_ref"], c) != _tokens(ref, c)]
    assert changed, "the same weights without the window / the chunking give the same tokens"
    if "buckets" in runs:  # every step of every kind padded to one bucket of a plan warmed through the model
        # (one model: each bucketed run warms every bucket through the whole model, minutes here)
        padded = runs["buckets"]
        assert f"warmed {padded['num_buckets']} buckets through the model" in padded["log"]
        buckets = re.findall(r"unified attention step: phase \S+, bucket (\S+), step shape", padded["log"])
        assert buckets, "no padded step was logged"
        # (The trace records one kind's steps; graphs learned from it, rounded in half powers of two, may not
        # hold the other kinds' shapes of a step, which then takes the tiled buckets: no ':p' bucket asserted.)
        assert_same_as_reference(padded, ref)
    print(name, "max |dlogprob| vs vLLM CPU attention", worst)


# ---------------------------------------------------------------------------------------- pooling

MODELS_HELPER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_models.py")


@pytest.mark.slow
def test_embeddings_through_the_unified_runner(tmp_path):
    """A tiny Llama as an embedding model (`runner="pooling"`: last-token pooling, normalized): vllm-gaudi
    runs pooling models one request at a time with its own metadata; through the unified runner each
    step is one unified batch (several prompts, prompts longer than the 64-token budget in chunks over
    their cached context) and the pooler reads the rows. Same vectors as vLLM's CPU attention (1e-5)."""
    import json
    import sys

    import numpy as np
    from test_vllm_gaudi import _run_engine

    model = H.make_tiny_llama(str(tmp_path / "model"), **H.MODELS["gqa"])
    trace = str(tmp_path / "trace.jsonl")

    def embed(name: str, gaudi: bool) -> dict:
        out = str(tmp_path / f"{name}.json")
        env = dict(VLLM_GAUDI_UNIFIED_RECORD_TRACE=trace) if gaudi else {}
        return _run_engine([sys.executable, MODELS_HELPER, "embed", model, out], out, gaudi, **env)

    got, ref = H.concurrently(lambda: embed("unified", True), lambda: embed("ref", False))
    assert "Using the unified attention backend GAUDI_UNIFIED_HPU_ATTN" in got["log"]
    assert "seq_pooling_type='LAST'" in ref["pooler_config"]
    diffs = [float(np.abs(np.subtract(a, b)).max()) for a, b in zip(got["embeddings"], ref["embeddings"])]
    assert len(diffs) == 8 and max(diffs) <= 1e-5, diffs
    with open(trace) as f:
        steps = [json.loads(line) for line in f if '"query_lens"' in line]
    assert any(len(s["query_lens"]) > 1 for s in steps)  # several prompts in one step
    assert any(c > 0 for s in steps for c in s["context_lens"])  # a prompt chunk over its cached context
    print("embeddings: max |d| vs vLLM CPU attention", max(diffs))


def _embeddings(tmp_path, model: str, name: str, gaudi: bool) -> dict:
    """`vllm_model_helpers.py embed` of `model` in a subprocess, through the unified runner when `gaudi`."""
    import sys

    import vllm_model_helpers as MH
    from test_vllm_gaudi import _run_engine

    out = str(tmp_path / f"{name}.json")
    return _run_engine([sys.executable, MH.__file__, "embed", "--model", model, "--out", out], out, gaudi,
                       VLLM_LOGGING_LEVEL="DEBUG")


def _largest_difference(got: dict, ref: dict) -> float:
    import numpy as np
    import vllm_model_helpers as MH

    worst = 0.0
    for task in ("token_embed", "embed"):
        for n, a, b in zip(MH.EMBED_LENGTHS, got[task], ref[task], strict=True):
            a, b = np.asarray(a), np.asarray(b)
            assert a.shape == b.shape and (task == "embed" or a.shape[0] == n)
            worst = max(worst, float(np.abs(a - b).max()))
    return worst


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["bert", "modernbert"])
def test_encoder_embeddings_through_the_unified_runner(tmp_path, arch):
    """Encoder-only models (`runner="pooling"`): vllm-gaudi gives their layers an encoder-only KV cache group
    with no cache and no block table; the unified runner plans each step bidirectional (every token sees its
    whole request) per attention kind and pads it to a power-of-two bucket. A tiny BERT, and a tiny ModernBERT
    (a global layer and two local ones, each token seeing keys within 8 positions on either side: a two-sided
    window of 9 in the same group). Seven ragged prompts in one step: per-token states and pooled embeddings
    as vLLM's CPU attention gives them (1e-5)."""
    import vllm_model_helpers as MH

    model = (MH.make_tiny_bert if arch == "bert" else MH.make_tiny_modernbert)(str(tmp_path / arch))
    got, ref = H.concurrently(lambda: _embeddings(tmp_path, model, "unified", True),
                              lambda: _embeddings(tmp_path, model, "ref", False))
    assert "Using the unified attention backend GAUDI_UNIFIED_HPU_ATTN" in got["log"]
    worst = _largest_difference(got, ref)
    assert worst <= 1e-5, worst
    # one step of the seven prompts (259 tokens) for each task, bidirectional, padded to powers of two
    steps = re.findall(r"unified attention step: phase c--, bucket (c--:q512:s0:u0:l8:c\d+), step shape "
                       r"c--:q259:s0:u0:l7:c(\d+), 7 requests, 259 tokens", got["log"])
    assert len(steps) == 2, re.findall(r"unified attention step: .*", got["log"])
    if arch == "modernbert":
        assert ("one plan per attention kind per step (full: 1 layers, sliding window 9: 2 layers), encoder-only"
                in got["log"])
    print(arch, "through the unified runner: max |d| vs vLLM CPU attention", worst, "steps", steps)


# ---------------------------------------------------------------------------------------- async scheduling

@pytest.mark.slow
def test_async_scheduling_through_the_unified_runner(tmp_path):
    """Async scheduling on (vLLM 0.32's default; vllm-gaudi runs it so): the step after a sample is
    scheduled before that sample reaches the host, so the runner takes it from vllm-gaudi's device copy
    of the previous step's samples (`_last_sampled_on_device`), never from the host input batch (which
    does not hold it yet). Same tokens with it on and off, and as vLLM's CPU attention (1e-4)."""
    import sys

    from test_vllm_gaudi import _run_engine

    model = H.make_tiny_llama(str(tmp_path / "model"), **H.MODELS["gqa"])

    def run(name: str, mode: str, gaudi: bool) -> dict:
        out = str(tmp_path / f"{name}.json")
        return _run_engine([sys.executable, MODELS_HELPER, mode, model, out], out, gaudi)

    names = {"on": ("async-on", True), "off": ("async-off", True), "ref": ("async-off", False)}
    runs = dict(zip(names, H.concurrently(*(partial(run, name, *how) for name, how in names.items()))))
    assert runs["on"]["async_scheduling"] and not runs["off"]["async_scheduling"]
    for name in ("on", "off"):
        assert "Using the unified attention backend GAUDI_UNIFIED_HPU_ATTN" in runs[name]["log"]
        worst = assert_same_as_reference(runs[name], runs["ref"])
        print("async", name, "max |dlogprob| vs vLLM CPU attention", worst)
    greedy = [c for c in runs["ref"]["results"] if c not in RANDOM_CASES]
    assert all(_tokens(runs["on"], c) == _tokens(runs["off"], c) for c in greedy)


# ---------------------------------------------------------------------------------------- refusals

def test_unserved_models_are_refused_at_start_up(gaudi):  # noqa: F811
    """What vllm-gaudi serves and the unified runner does not: a start-up error naming the model feature
    and the reason (the platform's `check_and_update_config` calls it before any model is loaded)."""
    from types import SimpleNamespace as NS

    from vllm_gaudi_unified.vllm_plugin.hpu_platform import refuse_unserved_models

    def config(mm: bool, lora, raw: bool = False, pruning: float = 0.0) -> NS:
        return NS(model_config=NS(is_multimodal_model=mm, architecture="Qwen2_5_VLForConditionalGeneration",
                                  use_mla=False, is_multimodal_raw_input_only_model=raw,
                                  multimodal_config=NS(video_pruning_rate=pruning)), lora_config=lora)

    refuse_unserved_models(config(False, None))
    refuse_unserved_models(config(True, None))  # multimodal: served (tests/test_vllm_multimodal.py)
    with pytest.raises(NotImplementedError, match=r"multimodal inputs \(Qwen2_5_VLForConditionalGeneration takes "
                                                  r"raw multimodal inputs.*VLLM_GAUDI_UNIFIED"):
        refuse_unserved_models(config(True, None, raw=True))
    with pytest.raises(NotImplementedError, match=r"with video pruning"):
        refuse_unserved_models(config(True, None, pruning=0.5))
    refuse_unserved_models(config(False, object()))  # LoRA: served (tests/test_vllm_gaudi_lora.py)
