"""The same-rules peer (benchmarks/gaudi_peer.py): vllm-gaudi's ops.py, unchanged, against the reference."""
from __future__ import annotations

import sys

import pytest
import torch

from benchmarks import baselines, gaudi_peer, scenarios

try:
    TARBALL, MISSING = gaudi_peer.find_tarball(), ""
except FileNotFoundError as exc:  # a clone without ../shared/third_party
    TARBALL, MISSING = None, str(exc)

pytestmark = pytest.mark.skipif(TARBALL is None, reason=f"vllm-gaudi archive: {MISSING}")


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("block_size", [16, 128])
def test_peer_matches_the_reference_on_every_scenario(block_size, padded):
    """Unpadded, and padded to vllm-gaudi's own `exp` buckets (padding prompts, decodes and
    blocks as its runner pads them): the same rows."""
    exp = gaudi_peer.ExpBuckets.for_server(256, 8192, 8192, block_size, 6000) if padded else None
    for sc in scenarios.scenarios(scale=1 / 16):
        lay = scenarios.layout(sc, block_size)
        g = torch.Generator().manual_seed(0)
        t, hq, hkv, d = sc.num_tokens, 4, 2, 16
        q, k, v = (torch.randn(t, h, d, generator=g, dtype=torch.float64) for h in (hq, hkv, hkv))
        kc = torch.randn(lay.num_blocks, block_size, hkv, d, generator=g, dtype=torch.float64)
        vc = torch.randn(lay.num_blocks, block_size, hkv, d, generator=g, dtype=torch.float64)
        ql, cl = list(sc.query_lens), list(sc.context_lens)
        ref = baselines.reference_fp32(q, k, v, kc, vc, ql, cl, [torch.as_tensor(b) for b in lay.owned], 0.25)
        out = gaudi_peer.build(q, k, v, kc, vc, ql, cl, lay.owned, 0.25, exp)()
        torch.testing.assert_close(out.float(), ref, atol=1e-5, rtol=1e-5, msg=sc.name)


def test_exp_buckets_are_vllm_gaudis_exponential_values():
    exp = gaudi_peer.ExpBuckets.for_server(256, 8192, 8192, 128, 6000)
    assert exp.prompt_bs[0] == 1 and exp.prompt_bs[-1] == 256 and exp.decode_blocks[-1] <= 3 * 6000
    assert gaudi_peer.exp_range(128, 128, 2048, 10) == [128, 256, 384, 512, 640, 896, 1152, 1536, 2048]
    assert gaudi_peer.ExpBuckets.up(300, [256, 512]) == 512 and gaudi_peer.ExpBuckets.up(600, [256, 512]) == 600


def test_ops_is_loaded_unchanged_and_leaves_no_stand_in_behind(monkeypatch):
    names = ["habana_frameworks", "vllm", "vllm_gaudi", "vllm_gaudi.extension", "vllm_gaudi.extension.ops",
             "vllm.model_executor.layers.quantization"]
    before = {n: sys.modules.get(n) for n in names}
    monkeypatch.setattr(gaudi_peer, "_LOADED", {})  # load again, here
    ns = gaudi_peer.load_vllm_gaudi(TARBALL)
    import tarfile

    with tarfile.open(TARBALL) as tf:
        member = next(m for m in tf.getmembers() if m.name.endswith("vllm_gaudi/extension/ops.py"))
        source = tf.extractfile(member).read().decode()
    assert "def flat_pa(" in source and ns.ops.flat_pa.__code__.co_filename.endswith("extension/ops.py")
    assert {n: sys.modules.get(n) for n in names} == before  # whatever was there (a real vLLM, the shared stand-in)

