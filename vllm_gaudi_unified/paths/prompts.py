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


def _keys(q, k, v, key_cache, value_cache, batch, k_scale, v_scale):
    """Query rows `[P, Qp, Hq, D]`, keys/values `[P, Kp, Hkv, D]` (context then new, contiguous per
    prompt; past them zero) and `[P, Kp]` positions of each prompt's real keys."""
    n = q.shape[0]
    rows = batch.prompt_rows.clamp(max=n - 1)
    qr, kn, vn = q[rows], k[rows], v[rows]
    cb = batch.prompt_blocks.shape[1]
    if cb == 0:
        kall, vall = kn, vn
    else:
        kc = read_blocks(key_cache, batch.prompt_blocks, k_scale, q.dtype).flatten(1, 2)  # [P, Cb*bs, Hkv, D]
        vc = read_blocks(value_cache, batch.prompt_blocks, v_scale, q.dtype).flatten(1, 2)
        keys = kc.shape[1]
        pos = torch.arange(keys + kn.shape[1], device=q.device)
        ctx = batch.prompt_ctx[:, None]
        src = torch.where(pos < ctx, pos, keys + (pos - ctx)).clamp(max=pos.numel() - 1)  # compact: context, new
        req = torch.arange(src.shape[0], device=q.device)[:, None]
        kall, vall = torch.cat([kc, kn], 1)[req, src], torch.cat([vc, vn], 1)[req, src]
    pos = torch.arange(kall.shape[1], device=q.device)
    valid = pos < (batch.prompt_ctx + batch.prompt_len)[:, None]  # [P, Kp]
    return qr, kall, vall, valid


def prompt_partial(q, k, v, key_cache, value_cache, batch, scale, soft_cap, k_scale=None, v_scale=None) -> Partial:
    """The partial form: strict-causal pairs and context of every prompt row through the matmul tiles
    (`tiles.attend` masks unseen keys and contains bad values itself), merged into the step's rows."""
    n = q.shape[0]
    qr, kall, vall, valid = _keys(q, k, v, key_cache, value_cache, batch, k_scale, v_scale)
    i = torch.arange(qr.shape[1], device=q.device)
    pos = torch.arange(kall.shape[1], device=q.device)
    mask = (pos[None, None, :] < (batch.prompt_ctx[:, None] + i[None, :])[..., None]) & valid[:, None, :]
    tile_attend = fused.sdpa_attend if fused.kernel_for(batch, q, soft_cap) == "hpu" else attend
    part = tile_attend(qr, kall, vall, mask, scale, soft_cap)
    return scatter_merge(part, batch.prompt_rows.reshape(-1), n)


def prompt_final(q, k, v, key_cache, value_cache, batch, scale, k_scale=None, v_scale=None) -> torch.Tensor:
    """The final form: `[P * Qp, Hq, D]` normalised rows in q's dtype (rows of `batch.prompt_rows`)."""
    from vllm_gaudi_unified.hpu import sdpa_final

    qr, kall, vall, valid = _keys(q, k, v, key_cache, value_cache, batch, k_scale, v_scale)
    p, qp, hq, d = qr.shape
    hkv = kall.shape[2]
    finite = torch.isfinite(kall).all(-1) & torch.isfinite(vall).all(-1)  # [P, Kp, Hkv]
    keep = (valid[..., None] & finite)[..., None]
    zero = torch.zeros((), dtype=kall.dtype, device=kall.device)
    kall, vall = torch.where(keep, kall, zero), torch.where(keep, vall, zero)
    i = torch.arange(qp, device=q.device)
    last = batch.prompt_ctx[:, None] + i[None, :]  # [P, Qp]: the last key each row sees
    mask = None
    if batch.prompt_blocks.shape[1]:
        pos = torch.arange(kall.shape[1], device=q.device)
        mask = (pos[None, None, :] <= last[..., None])[:, None]  # [P, 1, Qp, Kp]
    out = sdpa_final(qr.transpose(1, 2), kall.transpose(1, 2), vall.transpose(1, 2), mask, scale)
    out = out.transpose(1, 2).reshape(p * qp, hq, d)
    bad = (valid[..., None] & ~finite).to(torch.int32).cumsum(1)  # [P, Kp, Hkv]: bad keys up to each position
    seen = bad.gather(1, last.clamp(max=kall.shape[1] - 1)[..., None].expand(-1, -1, hkv)) > 0  # [P, Qp, Hkv]
    seen = seen.reshape(p * qp, hkv).repeat_interleave(hq // hkv, 1)
    return torch.where(seen[..., None], torch.full((), float("nan"), dtype=out.dtype, device=out.device), out)


def write_rows(out: torch.Tensor, rows: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """`out` `[n, Hq, D]` with `values` written at `rows` (`n` = no row: dropped)."""
    n = out.shape[0]
    full = torch.cat([out, out.new_zeros((1,) + out.shape[1:])])
    return full.index_copy(0, rows.reshape(-1), values.to(out.dtype))[:n]
