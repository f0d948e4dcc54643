"""The prompt route on the device: each prompt's context and new keys, one fused SDPA call for all.

The planner (`plan/prompts.py`) lists, per prompt, its query tokens (left
aligned in `prompt_len` rows), its context blocks and its context length. Here
the context blocks are gathered (`read_blocks`, fp8 dequantized after the
gather) and each prompt's keys are laid out contiguously, context first, then
its new keys: key `p` of prompt `r` is visible to its row `i` when
`p <= ctx[r] + i` (causal, bottom-right aligned). Keys past a prompt's own are
zeroed, so a poisoned unused cache slot is never read.

Two ways to finish, chosen by `final_rows` (all conditions there):

* **final** (no soft cap, no sinks, fused kernels on): one SDPA call over the
  padded batch (`hpu.sdpa_final`: FusedSDPA on a Gaudi, torch SDPA elsewhere:
  flash / cuDNN / memory-efficient on CUDA, math on the CPU); a batch whose
  prompts have no context is `is_causal` with no mask at all. The rows come out
  normalised and are written over the step's output: no LSE, no merge.
* **partial** (soft cap, sinks, float reference runs with fused kernels off):
  the same batch through the matmul tiles (`tiles.attend`), strict-causal (the
  self pair is the self path's), as a `Partial` the exact merge folds in.

Bad values: non-finite keys/values are zeroed before the fused call and the
rows that see one are set to NaN afterwards (a prefix count over the key
axis), as `fused.mark_bad_rows` does for the other fused calls, so a bad value
reaches exactly the rows that attend to it.
"""
from __future__ import annotations

import torch

from vllm_gaudi_unified.merge import Partial, scatter_merge
from vllm_gaudi_unified.paths import fused
from vllm_gaudi_unified.paths.kv_quant import read_blocks
from vllm_gaudi_unified.paths.tiles import attend


def final_rows(batch, query: torch.Tensor, soft_cap: float | None, sinks) -> bool:
    """Whether the prompt route writes its rows final (one fused SDPA call) or hands a `Partial` to the
    merge: final unless a soft cap or sinks need the statistics, or fused kernels are off."""
    return soft_cap is None and sinks is None and batch.plan.options.fused_kernels


def _keys(q, k, v, key_cache, value_cache, batch, k_scale, v_scale, compact: bool = True, context=None,
          first: int = 0):
    """Query rows `[P, Qp, Hq, D]`, keys/values `[P, Kp, Hkv, D]` and, per key position `[P, Kp]`: whether
    it is a real key of the prompt, and its position in the prompt's sequence (a row at sequence
    position `ctx + i` sees keys at positions `<= ctx + i`).

    `compact`: each prompt's keys contiguous, context then new keys (flash's segments need that);
    else the context blocks as gathered, then the new keys at `Cb * bs` (one copy less: a mask
    handles the gap after a partly filled last block). `context`: the context keys/values `[P, Cb*bs,
    Hkv, D]` already gathered (MLA's expanded form: `mla_prompts.py`), else read from the caches;
    `first`: q/k/v hold the step's tokens from `first` on (every prompt row is at or past it)."""
    n = q.shape[0]
    rows = (batch.prompt_rows - first).clamp(min=0, max=n - 1) if first else batch.prompt_rows.clamp(max=n - 1)
    qr, kn, vn = q[rows], k[rows], v[rows]
    cb = batch.prompt_blocks.shape[1]
    ctx, length = batch.prompt_ctx[:, None], batch.prompt_len[:, None]
    if cb == 0:
        pos = torch.arange(kn.shape[1], device=q.device)[None, :]
        return qr, kn, vn, pos < length, pos.expand(kn.shape[0], -1)
    if context is not None:
        kc, vc = context
    else:
        kc = read_blocks(key_cache, batch.prompt_blocks, k_scale, q.dtype).flatten(1, 2)  # [P, Cb*bs, Hkv, D]
        vc = read_blocks(value_cache, batch.prompt_blocks, v_scale, q.dtype).flatten(1, 2)
    keys = kc.shape[1]
    kall, vall = torch.cat([kc, kn], 1), torch.cat([vc, vn], 1)
    pos = torch.arange(keys + kn.shape[1], device=q.device)[None, :]
    if compact:
        src = torch.where(pos < ctx, pos, keys + (pos - ctx)).clamp(max=pos.numel() - 1)
        req = torch.arange(src.shape[0], device=q.device)[:, None]
        kall, vall = kall[req, src], vall[req, src]
        return qr, kall, vall, pos < ctx + length, pos.expand(kall.shape[0], -1)
    seq = torch.where(pos < keys, pos, ctx + (pos - keys))  # sequence position of each key
    real = torch.where(pos < keys, pos < ctx, pos - keys < length)
    return qr, kall, vall, real, seq


def prompt_partial(q, k, v, key_cache, value_cache, batch, scale, soft_cap, k_scale=None, v_scale=None) -> Partial:
    """The partial form: strict-causal pairs and context of every prompt row through the matmul tiles
    (`tiles.attend` masks unseen keys and contains bad values itself), merged into the step's rows."""
    n = q.shape[0]
    qr, kall, vall, valid, seq = _keys(q, k, v, key_cache, value_cache, batch, k_scale, v_scale, compact=False)
    i = torch.arange(qr.shape[1], device=q.device)
    mask = (seq[:, None, :] < (batch.prompt_ctx[:, None] + i[None, :])[..., None]) & valid[:, None, :]
    tile_attend = fused.sdpa_attend if fused.kernel_for(batch, q, soft_cap) == "hpu" else attend
    part = tile_attend(qr, kall, vall, mask, scale, soft_cap)
    return scatter_merge(part, batch.prompt_rows.reshape(-1), n)


def prompt_final(q, k, v, key_cache, value_cache, batch, scale, k_scale=None, v_scale=None,
                 flash: bool = False, context=None, first: int = 0) -> torch.Tensor:
    """The final form: `[P * Qp, Hq, Dv]` normalised rows in q's dtype (rows of `batch.prompt_rows`;
    `context`, `first`: as `_keys`).

    `flash` (CUDA kernels allowed): one flash varlen call, each prompt a segment of its real rows
    against its first `ctx + len` keys, causal bottom-right aligned: no mask at all. Else one SDPA call
    (`hpu.sdpa_final`: FusedSDPA on a Gaudi) over the padded batch, with the mask the layout needs."""
    from vllm_gaudi_unified.hpu import sdpa_final

    qr, kall, vall, valid, seq = _keys(q, k, v, key_cache, value_cache, batch, k_scale, v_scale, compact=flash,
                                       context=context, first=first)
    p, qp, hq, d = qr.shape
    hkv = kall.shape[2]
    finite = torch.isfinite(kall).all(-1) & torch.isfinite(vall).all(-1)  # [P, Kp, Hkv]
    keep = (valid[..., None] & finite)[..., None]
    zero = torch.zeros((), dtype=kall.dtype, device=kall.device)
    kall, vall = torch.where(keep, kall, zero), torch.where(keep, vall, zero)
    last = batch.prompt_ctx[:, None] + torch.arange(qp, device=q.device)[None, :]  # [P, Qp]: last position seen
    if flash:
        out = _flash_rows(qr, kall, vall, batch, scale)
    else:
        mask = None
        if batch.prompt_blocks.shape[1]:
            mask = ((seq[:, None, :] <= last[..., None]) & valid[:, None, :])[:, None]  # [P, 1, Qp, Kp]
        out = sdpa_final(qr.transpose(1, 2), kall.transpose(1, 2), vall.transpose(1, 2), mask, scale)
        out = out.transpose(1, 2).reshape(p * qp, hq, vall.shape[-1])  # MLA: values narrower than keys
    # rows that see a bad key: those at or past the first bad key's sequence position (a reduction, no scan)
    never = torch.iinfo(seq.dtype).max
    first = torch.where(valid[..., None] & ~finite, seq[..., None], never).amin(1)  # [P, Hkv]
    seen = first[:, None, :] <= last[..., None]  # [P, Qp, Hkv]
    seen = seen.reshape(p * qp, hkv).repeat_interleave(hq // hkv, 1)
    return torch.where(seen[..., None], torch.full((), float("nan"), dtype=out.dtype, device=out.device), out)


def _flash_rows(qr, kall, vall, batch, scale) -> torch.Tensor:
    """Flash varlen over the prompts: real rows packed prompt by prompt (padding rows after them, in no
    segment), keys `[P * Kp]` with segment r at `r * Kp` using its first `ctx + len`. Returns the rows in
    the padded `[P * Qp]` order."""
    p, qp, hq, d = qr.shape
    kp = kall.shape[1]
    lens = batch.prompt_len
    real = (torch.arange(qp, device=qr.device)[None, :] < lens[:, None]).reshape(-1)
    order = torch.argsort((~real).to(torch.int8), stable=True)  # real rows first, prompt by prompt
    cu_q = torch.cat([lens.new_zeros(1), torch.cumsum(lens, 0)]).to(torch.int32)
    cu_k = torch.arange(0, (p + 1) * kp, kp, device=qr.device, dtype=torch.int32)
    used = (batch.prompt_ctx + lens).to(torch.int32)
    part = fused.flash_varlen(qr.reshape(p * qp, hq, d)[order], kall.reshape(p * kp, -1, d),
                              vall.reshape(p * kp, -1, d), cu_q, cu_k, qp, kp, scale, causal=True, seqused_k=used)
    return torch.empty_like(part.acc, dtype=qr.dtype).index_copy_(0, order, part.acc.to(qr.dtype))


def write_rows(out: torch.Tensor | None, rows: torch.Tensor, values: torch.Tensor, n: int = 0) -> torch.Tensor:
    """`out` `[n, Hq, D]` with `values` written at `rows` (`n` = no row: dropped); `out` None: zeros of
    `n` rows (a step of prompts alone: no other path wrote anything)."""
    if out is None:
        full = values.new_zeros((n + 1,) + values.shape[1:])
    else:
        n = out.shape[0]
        full = torch.cat([out, out.new_zeros((1,) + out.shape[1:])])
    return full.index_copy_(0, rows.reshape(-1), values.to(full.dtype))[:n]
