"""Tile options measured per device kind (bucket_plans/device_options.py) and where they are used."""
from __future__ import annotations

from dataclasses import replace

from vllm_gaudi_unified.bucket_plans import device_options
from vllm_gaudi_unified.bucket_plans.settings import BUCKET_OPTIONS, ServerSettings, options_from_dict, options_to_dict
from vllm_gaudi_unified.plan import PlanOptions


def test_measured_kind_gets_its_options_and_keeps_the_rest():
    base = PlanOptions(batch_invariant=True, causal_tile=32)
    got = device_options.options_for_device("cuda:NVIDIA H100 80GB HBM3", base)
    assert (got.shared_rows, got.shared_tile_keys) == (256, 2048)
    assert got.batch_invariant and got.causal_tile == 32 and got.fused_kernels


def test_unmeasured_kinds_keep_the_defaults():
    for kind in ("hpu", "cpu", "cuda:Some Other GPU"):
        assert device_options.options_for_device(kind, BUCKET_OPTIONS) == BUCKET_OPTIONS


def test_device_kind():
    assert device_options.device_kind("cpu") == "cpu"
    assert device_options.device_kind("hpu") == "hpu"
    assert device_options.device_kind("cuda", "NVIDIA H100 80GB HBM3") in device_options.DEVICE_OPTIONS


def test_every_entry_is_valid_planner_options():
    for kind, fields in device_options.DEVICE_OPTIONS.items():
        replace(PlanOptions(), **fields)  # raises on an unknown field or a bad value


def test_the_choice_is_stored_with_the_bucket_plan_settings():
    opts = device_options.options_for_device("cuda:NVIDIA H100 80GB HBM3", BUCKET_OPTIONS)
    settings = ServerSettings(options=opts)
    assert options_from_dict(options_to_dict(settings.options)) == opts
