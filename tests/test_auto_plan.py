"""`VLLM_GAUDI_UNIFIED_BUCKETS=auto`: the robust plan learned at start-up for the server's own settings, made
by `buckets generate` in a child process and cached; the exponential plan for a batch-invariant server and
when the command fails."""
from __future__ import annotations

import sys
import types

import pytest
import torch

from vllm_gaudi_unified.plan import PlanOptions
from vllm_gaudi_unified.vllm_plugin import auto_plan as auto


class _Model:
    max_model_len = 512

    def get_num_layers(self, parallel):
        return 2

    def get_num_attention_heads(self, parallel):
        return 4

    def get_hidden_size(self):
        return 64

    def get_vocab_size(self):
        return 1000


def _server(num_speculative_tokens=0):
    spec = types.SimpleNamespace(num_speculative_tokens=num_speculative_tokens) if num_speculative_tokens else None
    config = types.SimpleNamespace(scheduler_config=types.SimpleNamespace(max_num_seqs=8, max_num_batched_tokens=96),
                                   model_config=_Model(), parallel_config=None,
                                   cache_config=types.SimpleNamespace(num_gpu_blocks=80), speculative_config=spec)
    kv = types.SimpleNamespace(block_size=16, num_kv_heads=2, head_size=32, dtype=torch.float32)
    return config, kv


def test_auto_is_the_robust_mix_plan_of_the_servers_settings_made_once_then_loaded(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    config, kv = _server(num_speculative_tokens=2)
    plan = auto.auto_plan(config, kv, PlanOptions(), None)
    settings, spec = auto.server_settings(config, kv, PlanOptions(), None, "")
    assert plan.strategy == "robust" and plan.settings == settings and plan.model == spec
    assert settings.num_speculative_tokens == 2 and settings.max_num_batched_tokens == 96
    assert plan.prompt_graphs and len(plan) + len(plan.prompt_graphs) <= 100 and plan.covers_limits()
    made = list((tmp_path / "vllm_gaudi_unified").iterdir())
    assert len(made) == 1
    monkeypatch.setattr(auto, "make_plan", lambda *a: pytest.fail("the cached plan was made again"))
    again = auto.auto_plan(config, kv, PlanOptions(), None)
    assert again.buckets == plan.buckets and again.prompt_graphs == plan.prompt_graphs
    other = auto.cached_plan_path(*auto.server_settings(_server()[0], kv, PlanOptions(), None, ""))
    assert other != str(made[0])  # other settings, another plan


def test_a_batch_invariant_server_and_a_failed_command_get_the_exponential_plan(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    config, kv = _server()
    invariant = auto.auto_plan(config, kv, PlanOptions(batch_invariant=True), None)
    assert invariant.strategy == "exponential" and invariant.settings.options.batch_invariant
    monkeypatch.setattr(auto, "generate_command", lambda *a: [sys.executable, "-c", "raise SystemExit(3)"])
    fallback = auto.auto_plan(config, kv, PlanOptions(), None)
    assert fallback.strategy == "exponential" and fallback.prompt_graphs
