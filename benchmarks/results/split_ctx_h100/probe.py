"""What `fused.sdpa_lse` gives on this GPU (the split prompt form's two calls), before the benchmarks.

cuDNN with its LSE, GQA 32/8 without repeating K/V, a `[P, 1, 1, K]` key-padding bias broadcast over
the rows, `is_causal` top-left, against the float32 softmax; and what it returns for a row whose keys
are all masked (a prompt with context 0: the split form selects such rows away). Run from the
repository root: `python benchmarks/results/split_ctx_h100/probe.py`.
"""
import torch

from vllm_gaudi_unified.paths import fused

torch.manual_seed(0)
dev, dt = torch.device("cuda"), torch.bfloat16
p, hq, hkv, s, n, d = 3, 32, 8, 256, 384, 128
q = torch.randn(p, s, hq, d, device=dev, dtype=dt).transpose(1, 2)  # BSHD memory, as the route hands it
k, v = (torch.randn(p, n, hkv, d, device=dev, dtype=dt).transpose(1, 2) for _ in range(2))
ctx = torch.tensor([200, 0, 384], device=dev)
bias = torch.zeros(p, 1, 1, n, device=dev, dtype=dt).masked_fill(
    (torch.arange(n, device=dev)[None, :] >= ctx[:, None])[:, None, None], float("-inf"))
g = hq // hkv
for causal in (False, True):
    kk, vv = (x[:, :, :s] if causal else x for x in (k, v))
    out, lse = fused.sdpa_lse(q, kk, vv, None if causal else bias, 0.088, causal=causal)
    sc = (q.float() @ kk.float().repeat_interleave(g, 1).transpose(-1, -2)) * 0.088
    sc = sc.masked_fill(~torch.ones(s, s, device=dev, dtype=torch.bool).tril(), float("-inf")) if causal \
        else sc + bias.float()
    want = torch.softmax(sc, -1) @ vv.float().repeat_interleave(g, 1)
    rows = [0, 1, 2] if causal else [0, 2]
    print(f"causal={causal}: out {tuple(out.shape)} {out.dtype}, lse {tuple(lse.shape)} {lse.dtype}; "
          f"max |out - ref| {(out.float() - want)[rows].abs().max().item():.3e}, "
          f"max |lse - ref| {(lse - sc.logsumexp(-1))[rows].abs().max().item():.3e}")
    if not causal:
        print(f"  fully masked rows (context 0): out finite {torch.isfinite(out[1]).all().item()}, "
              f"out[0,0,:4] {out[1, 0, 0, :4].tolist()}, lse {lse[1, 0, :4].tolist()}")
