"""Gaudi dispatch: the selection logic (the HPU kernel itself cannot run without Gaudi)."""
import sys

import pytest
import torch

from vllm_gaudi_unified import hpu


@pytest.mark.parametrize("device, dtype, importable, expected", [
    ("cpu", torch.bfloat16, True, "torch"),
    ("cuda", torch.bfloat16, True, "torch"),
    ("hpu", torch.bfloat16, False, "torch"),
    ("hpu", torch.float32, True, "torch"),
    ("hpu", torch.bfloat16, True, "hpu"),
])
def test_select_softmax(device, dtype, importable, expected):
    assert hpu.select_softmax(device, dtype, importable) == expected


def test_cpu_tensors_use_torch_softmax_and_never_import_habana():
    scores = torch.tensor([[0.0, float("-inf"), 1.0], [float("-inf")] * 3])
    assert hpu.masked_softmax_for(scores) is hpu.masked_softmax_torch
    p, m, s = hpu.masked_softmax_torch(scores)
    assert torch.isinf(m[1]) and s[1] == 0 and torch.equal(p[1], torch.zeros(3))
    assert "habana_frameworks" not in sys.modules


def test_package_imports_without_vllm_or_habana():
    import subprocess

    code = ("import sys; import vllm_gaudi_unified, vllm_gaudi_unified.plan, vllm_gaudi_unified.attention; "
            "bad = [m for m in ('vllm', 'habana_frameworks') if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)
