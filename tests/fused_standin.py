"""Exact CPU stand-ins for the fused kernels, so the fused paths' plumbing is checked in float64.

`flash` has the calling convention and outputs of `torch.ops.aten._flash_attention_forward`
(varlen or batched, GQA, bottom-right causal, left window, `seqused_k`; LSE `[Hq, rows]` for
varlen, `[B, Hq, S]` batched). It reads only the keys a segment may use and leaves rows outside
every segment NaN, as garbage the callers must drop. `sdpa_recomp_fwd` has the outputs vllm-gaudi
reads from `torch.ops.hpu.sdpa_recomp_fwd` (normalised output, row max, inverse row sum).
"""
from __future__ import annotations

import torch


def _segment(q, k, v, scale, causal, window_left):
    """q `[n, Hq, D]`, k/v `[m, Hkv, D]` -> (out `[n, Hq, D]`, lse `[Hq, n]`)."""
    hq, hkv = q.shape[1], k.shape[1]
    kk = k.transpose(0, 1).repeat_interleave(hq // hkv, 0)
    vv = v.transpose(0, 1).repeat_interleave(hq // hkv, 0)
    s = (q.transpose(0, 1) @ kk.transpose(1, 2)) * scale  # [Hq, n, m]
    n, m = q.shape[0], k.shape[0]
    i = torch.arange(n)[:, None] + (m - n)
    j = torch.arange(m)[None, :]
    keep = torch.ones(n, m, dtype=torch.bool)
    if causal:
        keep &= j <= i
    if window_left is not None:
        keep &= j >= i - window_left
    s = s.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    return (p @ vv).transpose(0, 1), lse


def flash(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, return_debug_mask, *, scale=None,
          window_size_left=None, window_size_right=None, seqused_k=None, alibi_slopes=None):
    assert dropout_p == 0.0 and not return_debug_mask and alibi_slopes is None
    assert window_size_right in (None, 0)
    batched = cu_q is None
    if batched:
        b, sq, sk = q.shape[0], q.shape[1], k.shape[1]
        cu_q, cu_k = torch.arange(b + 1) * sq, torch.arange(b + 1) * sk
        q, k, v = q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1)
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = torch.full(q.shape, float("nan"), dtype=q.dtype)
    lse = torch.full((q.shape[1], q.shape[0]), float("nan"), dtype=lse_dtype)
    cu_q, cu_k = cu_q.tolist(), cu_k.tolist()
    for i in range(len(cu_q) - 1):
        a, b_ = cu_q[i], cu_q[i + 1]
        c, e = cu_k[i], cu_k[i + 1]
        assert 0 <= b_ - a <= max_q and 0 <= e - c <= max_k, "segment longer than max_q / max_k"
        if seqused_k is not None:
            e = c + int(seqused_k[i])
        if b_ == a:
            continue
        o, s = _segment(q[a:b_].double(), k[c:e].double(), v[c:e].double(), scale, is_causal, window_size_left)
        out[a:b_], lse[:, a:b_] = o.to(q.dtype), s.to(lse_dtype)
    if batched:
        out = out.view(b, sq, *out.shape[1:])
        lse = lse.view(-1, b, sq).transpose(0, 1)
    return out, lse, None, None, None


def sdpa_recomp_fwd(q, k, v, bias, dropout_p, scale, is_causal, requires_backward, softmax_mode, valid_len,
                    padding_side):
    """q/k/v `[B, H, S, D]`, additive `bias` (or None), `is_causal` top-left -> (out, m `[B, H, S, 1]`,
    linv `[B, H, S, 1]`, seed)."""
    assert requires_backward and dropout_p == 0.0
    s = (q.double() @ k.double().transpose(-1, -2)) * scale
    if bias is not None:
        s = s + bias.double()
    if is_causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).tril().logical_not(), float("-inf"))
    m = s.amax(-1, keepdim=True)
    p = torch.exp(s - m)
    total = p.sum(-1, keepdim=True)
    return (p / total) @ v.double(), m, 1.0 / total, None
