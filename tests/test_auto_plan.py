"""`VLLM_GAUDI_UNIFIED_BUCKETS=auto`: the robust plan learned at start-up for the server's own settings, made
by `buckets generate` in a child process and cached, in parts where the runner runs steps in parts; the
exponential plan for a batch-invariant server and when the command fails."""
from __future__ import annotations

import sys
import types

import pytest
import torch

from vllm_gaudi_unified.plan import PlanOptions
from vllm_gaudi_unified.vllm_plugin import auto_plan as auto
from vllm_gaudi_unified.vllm_plugin.steps import ONE_CALL


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
    plan = auto.auto_plan(config, kv, PlanOptions(), None, "", ONE_CALL)
    settings, spec = auto.server_settings(config, kv, PlanOptions(), None, "")
    assert plan.strategy == "robust" and plan.settings == settings and plan.model == spec
    assert settings.num_speculative_tokens == 2 and settings.max_num_batched_tokens == 96
    assert plan.prompt_graphs and len(plan) + len(plan.prompt_graphs) <= 100 and plan.covers_limits()
    made = list((tmp_path / "vllm_gaudi_unified").iterdir())
    assert len(made) == 1
    monkeypatch.setattr(auto, "make_plan", lambda *a: pytest.fail("the cached plan was made again"))
    again = auto.auto_plan(config, kv, PlanOptions(), None, "", ONE_CALL)
    assert again.buckets == plan.buckets and again.prompt_graphs == plan.prompt_graphs
    other = auto.cached_plan_path(*auto.server_settings(_server()[0], kv, PlanOptions(), None, ""))
    assert other != str(made[0])  # other settings, another plan


def test_a_batch_invariant_server_and_a_failed_command_get_the_exponential_plan(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    config, kv = _server()
    invariant = auto.auto_plan(config, kv, PlanOptions(batch_invariant=True), None, "", None)
    assert invariant.strategy == "exponential" and invariant.settings.options.batch_invariant
    monkeypatch.setattr(auto, "generate_command", lambda *a: [sys.executable, "-c", "raise SystemExit(3)"])
    fallback = auto.auto_plan(config, kv, PlanOptions(), None, "", ONE_CALL)
    assert fallback.strategy == "exponential" and fallback.prompt_graphs


def test_auto_in_parts_is_buckets_generate_parts_under_its_own_cache_key(tmp_path, monkeypatch):
    """Where the runner runs steps in parts (`parts_refusal` None), `auto` runs `buckets generate --parts` with the
    loads and margin of `PARTS_FLAGS` (flags the command's parser takes as such), cached apart from the whole
    plan of the same settings. (`test_auto_is_the_robust_mix_plan...` runs the command itself.)"""
    from vllm_gaudi_unified.tools.cli import build_parser

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    config, kv = _server()
    settings, spec = auto.server_settings(config, kv, PlanOptions(), None, "")
    whole, parts = (auto.generate_command(settings, spec, "p.json", p) for p in (False, True))
    assert auto.PARTS_FLAGS == ("--parts", "--load-fractions", "0.75,0.5,0.375,0.25,0.0625", "--margin-sizes",
                                "unique,causal")
    assert "--parts" not in whole and [a for a in parts if a not in whole] == list(auto.PARTS_FLAGS)
    args = build_parser().parse_args(parts[parts.index("buckets"):])
    assert args.parts and args.load_fractions == "0.75,0.5,0.375,0.25,0.0625" and args.margin_sizes == "unique,causal"
    assert not build_parser().parse_args(whole[whole.index("buckets"):]).parts
    assert auto.cached_plan_path(settings, spec, True) != auto.cached_plan_path(settings, spec) == \
        auto.cached_plan_path(settings, spec, False)


@pytest.mark.parametrize("refusal, whole_steps, invariant, parts", [
    (None, None, False, True),  # vllm-gaudi's torch.compile mode, a model that runs parts
    ("vllm-gaudi runs in lazy mode", None, False, False),
    (ONE_CALL, None, False, False),  # the CPU platform (`backend.py`: StepHooks.create's defaults)
    (None, "not MLA", False, False),  # another model
    (None, None, True, None),  # batch-invariant: the exponential plan, no command
])
def test_auto_makes_a_plan_in_parts_only_where_the_runner_runs_parts(tmp_path, monkeypatch, refusal, whole_steps,
                                                                     invariant, parts):
    """`_load_bucket_plan("auto", ...)` (as `StepHooks.create` calls it) asks `make_plan` for a plan in parts only
    where neither the runner (`parts_refusal`) nor the model (`whole_steps`) says why not, and logs which kind
    and why in one line."""
    from vllm_gaudi_unified.vllm_plugin.steps import _load_bucket_plan

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    config, kv = _server()
    asked, lines = [], []

    def make(settings, spec, path, in_parts=False):
        asked.append((in_parts, path == auto.cached_plan_path(settings, spec, in_parts)))
        raise OSError("not made here")

    monkeypatch.setattr(auto, "make_plan", make)
    monkeypatch.setattr(auto, "with_simulated_prompt_graphs", lambda plan: plan)  # (the fallback's, seconds)
    monkeypatch.setattr(auto.logger, "info", lambda msg, *a: lines.append(msg % a))
    kwargs = {} if refusal == ONE_CALL else {"parts_refusal": refusal, "whole_steps": whole_steps}
    plan = _load_bucket_plan("auto", config, kv, PlanOptions(batch_invariant=invariant), None, **kwargs)
    assert plan.strategy == "exponential"  # (the command failed, or batch-invariant)
    assert asked == ([] if parts is None else [(parts, True)])
    made = [x for x in lines if x.startswith("Unified attention: auto makes")]
    assert len(made) == 1
    if parts:
        assert "a plan in parts (buckets generate --parts): this runner runs steps in parts" in made[0]
    else:
        assert ("the exponential plan" if invariant else f"a whole plan, not one in parts: {refusal or whole_steps}") \
            in made[0]
