"""MLA's one-token requests in the batch-invariant mode (paths/mla_invariant.py): the Triton MLA kernel in
position-fixed splits, bitwise the same alone and in any batch; cases in tests/mla_invariant_cases.py."""
from __future__ import annotations

import pytest
import torch

from conftest import run_interpreted
from vllm_gaudi_unified import PlanOptions, build_unified_batch
from vllm_gaudi_unified.mla import latent_views
from vllm_gaudi_unified.paths import mla_invariant, mla_invariant_torch
from vllm_gaudi_unified.paths.unique import triton_importable

HAS_TRITON = triton_importable()
ON_CUDA = torch.cuda.is_available() and HAS_TRITON


@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton (its interpreter runs the kernels on the CPU)")
def test_mla_invariant_interpreted():
    """float64 and float32 under the interpreter, a token's keys in several loop steps and splits."""
    import mla_invariant_cases

    words = run_interpreted("mla_invariant_cases.py")
    runs = 2 * sum(len({0, len(o) // 2, len(o)}) for _, o, _, _ in mla_invariant_cases.CASES)  # dtypes x positions
    assert words == ["ok", str(runs)]


@pytest.mark.skipif(not ON_CUDA, reason="needs CUDA and Triton")
def test_mla_invariant_on_cuda():
    """Compiled, bfloat16 and float16, the small constants (the Triton kernel: 16 heads)."""
    import mla_invariant_cases

    assert mla_invariant_cases.check("cuda") > 0


@pytest.mark.skipif(not ON_CUDA, reason="needs CUDA and Triton")
def test_mla_invariant_deepseek_on_cuda():
    """DeepSeek's shapes, bf16, the module's constants (splits of 2048 keys, block 128): 64-head programs (the
    seesaw kernel on sm_90), three splits launched alone against ten in the batch (the ordered combine), and a
    one-split decode (its rows from the kernel) alone and beside a longer one."""
    import mla_invariant_cases

    assert mla_invariant_cases.check_long("cuda") > 0


def test_mla_invariant_torch_route():
    """The torch route's decodes (`mla_invariant_torch.py`) on the CPU: float64, float32 and bfloat16 (fp32
    scores), and bfloat16 with the scores in the product's 16 bits (a Gaudi's); chunks shared by several
    decodes (share calls in the batch, one-row tiles alone), a padded bucket."""
    import mla_invariant_cases

    assert mla_invariant_cases.check_torch("cpu") == 87
    assert mla_invariant_cases.check_torch("cpu", dtypes=[torch.bfloat16], gaudi_scores=True) == 29


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_mla_invariant_torch_on_the_gaudi_route():
    """On CUDA's Gaudi route (`fused.gaudi_route()`: no Triton, the products' 16-bit scores): bf16 and fp32 at
    the small shapes, and at DeepSeek's shapes with the default options (bitwise)."""
    import mla_invariant_cases

    from vllm_gaudi_unified.paths import fused

    with fused.gaudi_route():
        assert mla_invariant_cases.check_torch("cuda", dtypes=[torch.bfloat16, torch.float32]) == 58
        assert mla_invariant_cases.check_torch("cuda", long=True) == 5


def test_latent_prompt_bf16_against_the_reference():
    """DeepSeek's shapes in bf16 on the CPU's torch route: the score products' output is fp32 (`tiles.score_product`),
    so a 4-token prompt's rows stay within 1e-2 of the reference (bf16 scores were 0.027 off)."""
    import mla_invariant_cases

    mla_invariant_cases.check_prompt_bf16("cpu")


def test_route_conditions():
    """Taken by the step's device, cache and options only: off CUDA, with a soft cap, sinks, or values that
    are not a view of the keys, the invariant mode's other routes take the rows."""
    cache = torch.randn(4, 16, 24)
    kc, vc = latent_views(cache, 16)
    opts = PlanOptions(batch_invariant=True)
    batch = build_unified_batch([1, 1], [5, 9], [[1, -1], [2, -1]], 16, options=opts)
    q = torch.randn(2, 4, 24)
    assert not mla_invariant.applies(batch, q, kc, vc, None, None, None, None)  # the CPU
    assert mla_invariant.route(batch, q, kc, vc, None, None, None, None).func is mla_invariant_torch.decode_rows
    assert mla_invariant.route(batch, q, kc, vc, 5.0, None, None, None) is None  # the tile route
    assert mla_invariant.route(batch, q, kc, vc.clone(), None, None, None, None) is None
    if ON_CUDA:
        cuda = batch.to("cuda")
        qc, (kcc, vcc) = q.cuda().bfloat16(), latent_views(cache.cuda().bfloat16(), 16)  # (views of one memory)
        assert mla_invariant.applies(cuda, qc, kcc, vcc, None, None, None, None)
        assert mla_invariant.route(cuda, qc, kcc, vcc, None, None, None, None) is mla_invariant.decode_rows
        assert not mla_invariant.applies(cuda, qc, kcc, vcc, 5.0, None, None, None)
        assert not mla_invariant.applies(cuda, qc, kcc, vcc.clone(), None, None, None, None)
        assert not mla_invariant.applies(cuda, qc, kcc, vcc, None, object(), None, None)
