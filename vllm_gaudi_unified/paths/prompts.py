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
  With context blocks in the bucket, **split** (`split_context`): two fused calls with statistics
  (`fused.sdpa_lse`: FusedSDPA's forward with statistics on a Gaudi, cuDNN on CUDA), the context keys
  under a key-padding bias `[P, 1, 1, Cb*bs]` and the new keys `is_causal` with no mask, and the exact
  merge of the two in the compute dtype: no `[P, 1, Qp, Kp]` bias read per tile and half the new-key
  pairs not computed. A prompt without context takes the new keys' rows alone.
* **partial** (soft cap, sinks, float reference runs with fused kernels off):
  the same batch through the matmul tiles (`tiles.attend`), strict-causal (the
  self pair is the self path's), as a `Partial` the exact merge folds in.

Bad values (final form), in one elementwise pass fused into the gather: the slots no row may read (past a
prompt's context, padding blocks and new keys) are zeroed, so a poisoned unused slot reaches no output. A
real context key is seen by every row of its prompt, so a non-finite one reaches exactly those rows by
itself. A new key is hidden from earlier rows by the causal mask, where `0 * NaN` would still leak:
non-finite new keys and values are zeroed and the rows at or past the first one set to NaN afterwards
(as `fused.mark_bad_rows` does for the other fused calls). Prompts without context off a Gaudi mark
through the inputs instead where the call selects (`_causal_keys`, `causal_selects`).
"""
from __future__ import annotations

import torch

from vllm_gaudi_unified.flags import env_flag
from vllm_gaudi_unified.merge import Partial, scatter_merge
from vllm_gaudi_unified.paths import fused
from vllm_gaudi_unified.paths.kv_quant import is_fp8, read_blocks
from vllm_gaudi_unified.paths.tiles import attend
from vllm_gaudi_unified.plan.prompts import SPLIT_MIN_PAIRS


def final_rows(batch, query: torch.Tensor, soft_cap: float | None, sinks) -> bool:
    """Whether the prompt route writes its rows final (one fused SDPA call) or hands a `Partial` to the
    merge: final unless a soft cap or sinks need the statistics, or fused kernels are off."""
    return soft_cap is None and sinks is None and batch.plan.options.fused_kernels


#: The split form for buckets with context blocks (`split_context`): None (default) from `SPLIT_MIN_PAIRS` on;
#: `VLLM_GAUDI_UNIFIED_PROMPT_SPLIT=1` always, `=0` never (the one call with the full bias, for
#: measurements). Graphs and compiled functions keep the form they were made under
#: (`graphs.bucket_key` includes it).
SPLIT_CONTEXT: bool | None = env_flag("VLLM_GAUDI_UNIFIED_PROMPT_SPLIT")
#: `SPLIT_MIN_PAIRS` (`plan/prompts.py`, where the planned work counts it): from that grid size on the split form.


def split_context(batch, same_head_dims: bool = True) -> bool:
    """Whether the final form runs split (context keys, then new keys causal, merged) rather than one
    call with a `[P, 1, Qp, Kp]` bias: a function of the bucket alone (context blocks in it), so one
    graph per bucket holds, and only where values have the keys' head dim (MLA's latent form keeps the
    one call: the CPU and cuDNN kernels with statistics take one head dim).

    Measured (H100, chunked prefill 2 x 2048 over 6144, block 128, `python -m benchmarks.speed
    --rounds 5`): 1.236 ms split against 1.689 ms for the one call (vllm-gaudi's ops 1.686): the one call reads
    its `[P, 1, Qp, Kp]` bias in every tile and computes every pair above the diagonal; cuDNN's time went
    from 1581 to 1077 us for the two calls. Mixed steps (4 x 512 over 1.5k) 1.931 against 1.933 ms. Small
    grids keep the one call (`SPLIT_MIN_PAIRS`), unless `SPLIT_CONTEXT` forces either form."""
    blocks, forced = getattr(batch, "prompt_blocks", None), SPLIT_CONTEXT
    if (forced is not None and not forced) or not same_head_dims or blocks is None or 0 in blocks.shape:
        return False
    p, qp = batch.prompt_rows.shape
    return bool(forced) or p * qp * blocks.shape[1] * batch.block_size >= SPLIT_MIN_PAIRS


def _keys(q, k, v, key_cache, value_cache, batch, k_scale, v_scale, compact: bool = True, clean: bool = False,
          context=None, first: int = 0, split: bool = False):
    """Query rows `[P, Qp, Hq, D]`, keys/values `[P, Kp, Hkv, D]` and, per key position `[P, Kp]`: whether
    it is a real key of the prompt, and its position in the prompt's sequence (a row at sequence
    position `ctx + i` sees keys at positions `<= ctx + i`); with `clean`, also `[P, Qp, Hkv]`: the new
    keys whose key or value is not finite (else None).

    `compact`: each prompt's keys contiguous, context then new keys (flash's segments need that);
    else the context blocks as gathered, then the new keys at `Cb * bs` (one copy less: a mask
    handles the gap after a partly filled last block). `context`: the context keys/values `[P, Cb*bs,
    Hkv, D]` already gathered (MLA's expanded form: `mla_prompts.py`), else read from the caches;
    `first`: q/k/v hold the step's tokens from `first` on (every prompt row is at or past it); `split`
    (the split form, non-compact, with context blocks): keys and values as (context, new) pairs, not
    concatenated.

    `clean` (the final form's containment, module docstring): context slots past a prompt's context and
    new keys past its tokens are zeroed, and so are non-finite new keys and values. Elementwise on the
    gather, so the compiled gather writes the clean copy in the same pass; only the new keys are
    tested for finiteness (a real context key is seen by every row of its prompt)."""
    n = q.shape[0]
    rows = (batch.prompt_rows - first).clamp(min=0, max=n - 1) if first else batch.prompt_rows.clamp(max=n - 1)
    qr, kn, vn = q[rows], k[rows], v[rows]
    cb = batch.prompt_blocks.shape[1]
    ctx, length = batch.prompt_ctx[:, None], batch.prompt_len[:, None]
    new_bad = None
    if clean:
        zero = torch.zeros((), dtype=kn.dtype, device=kn.device)
        finite = fused.finite_heads(kn, vn)  # [P, Qp, Hkv]
        real = (torch.arange(kn.shape[1], device=q.device)[None, :] < length)[..., None]
        new_bad = real & ~finite
        keep = (real & finite)[..., None]
        kn, vn = torch.where(keep, kn, zero), torch.where(keep, vn, zero)
    if cb == 0:
        pos = torch.arange(kn.shape[1], device=q.device)[None, :]
        return qr, kn, vn, pos < length, pos.expand(kn.shape[0], -1), new_bad
    if context is not None:
        kc, vc = context
    else:
        kc = read_blocks(key_cache, batch.prompt_blocks, k_scale, q.dtype).flatten(1, 2)  # [P, Cb*bs, Hkv, D]
        vc = read_blocks(value_cache, batch.prompt_blocks, v_scale, q.dtype).flatten(1, 2)
    keys = kc.shape[1]
    if clean:  # the unused slots of a partial last block and the padding blocks (id 0) never reach a row
        used = (torch.arange(keys, device=q.device)[None, :] < ctx)[..., None, None]
        kc, vc = torch.where(used, kc, zero), torch.where(used, vc, zero)
    if split:
        seq, real = _positions(batch, keys, kn.shape[1])
        return qr, (kc, kn), (vc, vn), real, seq, new_bad
    kall, vall = torch.cat([kc, kn], 1), torch.cat([vc, vn], 1)
    pos = torch.arange(keys + kn.shape[1], device=q.device)[None, :]
    if compact:
        src = torch.where(pos < ctx, pos, keys + (pos - ctx)).clamp(max=pos.numel() - 1)
        req = torch.arange(src.shape[0], device=q.device)[:, None]
        kall, vall = kall[req, src], vall[req, src]
        return qr, kall, vall, pos < ctx + length, pos.expand(kall.shape[0], -1), new_bad
    seq, real = _positions(batch, keys, kn.shape[1])
    return qr, kall, vall, real, seq, new_bad


def _clean_keys(q, k, v, key_cache, value_cache, batch, split: bool = False):
    """`_keys(compact=False, clean=True)` for an unquantized cache, as one gather: key `p < Cb * bs` of
    prompt `r` is cache slot `p % bs` of its block `p // bs` (zero past its context), key `Cb * bs + j`
    its token `j` (zero past its tokens, or where not finite). Both sources are indexed per output
    element, so the compiled function writes K and V in SDPA's layout in one pass, with no
    concatenated or cleaned copy in between. On a grid step (`plan.prompt_grid`) the rows are
    arithmetic, not read, and the queries are a view of the step's rows. `split` (the split form, with
    context blocks): keys and values as (context `[P, Cb * bs]`, new `[P, Qp]`) pairs, each written in
    its fused call's layout by its own pass (slices of one tensor were copied before each call: 2 x 34 +
    2 x 16 us on a chunked step of 2 x 2k over 6k, H100)."""
    n, dev = q.shape[0], q.device
    p, qp = batch.prompt_rows.shape
    grid = batch.plan.prompt_grid
    rows = torch.arange(p * qp, device=dev).view(p, qp) if grid else batch.prompt_rows.clamp(max=n - 1)
    qr = q[: p * qp].view(p, qp, *q.shape[1:]) if grid else q[rows]
    blocks = batch.prompt_blocks
    cb, bs = blocks.shape[1], key_cache.shape[1]
    keys = cb * bs
    ctx, length = batch.prompt_ctx[:, None], batch.prompt_len[:, None]
    finite = fused.finite_heads(k, v)  # [n, Hkv]: per token, not per row
    real = (torch.arange(qp, device=dev)[None, :] < length)[..., None]
    new_bad = real & ~finite[rows]  # [P, Qp, Hkv]
    pos = torch.arange(keys + qp, device=dev)
    in_ctx = (pos < keys)[None, :]
    j = (pos - keys).clamp(min=0, max=qp - 1)
    tok = rows[:, j]  # [P, Kp]
    use_new = (~in_ctx)[..., None] & real[:, j] & finite[tok]  # [P, Kp, Hkv]
    zero = torch.zeros((), dtype=k.dtype, device=dev)
    if cb:
        blk = blocks[:, (pos // bs).clamp(max=cb - 1)]  # [P, Kp]
        off = (pos % bs).expand(p, -1)
        use_ctx = (in_ctx & (pos[None, :] < ctx))[..., None, None]  # [P, Kp, 1, 1]
        pick = lambda cache, new: torch.where(use_ctx, cache[blk, off],  # noqa: E731
                                              torch.where(use_new[..., None], new[tok], zero))
    else:
        pick = lambda cache, new: torch.where(use_new[..., None], new[tok], zero)  # noqa: E731
    seq, valid = _positions(batch, keys, qp)
    # written heads-major, SDPA's `[P, Hkv, Kp, D]` contiguous, by the same pass (cuDNN: 0.3-1 % faster on
    # the chunked prefill than the token-major copy, H100)
    heads_major = lambda x: x.transpose(1, 2).contiguous().transpose(1, 2)  # noqa: E731
    if split and cb:  # the same elements, context and new keys in two tensors
        ctx_part = lambda cache: torch.where(use_ctx[:, :keys], cache[blk[:, :keys], off[:, :keys]], zero)  # noqa: E731
        new_part = lambda new: torch.where(use_new[:, keys:, :, None], new[rows], zero)  # noqa: E731
        kall, vall = ((heads_major(ctx_part(c)), heads_major(new_part(x))) for c, x in ((key_cache, k),
                                                                                      (value_cache, v)))
        return qr, kall, vall, valid, seq, new_bad
    kall, vall = (heads_major(pick(c, x)) for c, x in ((key_cache, k), (value_cache, v)))
    return qr, kall, vall, valid, seq, new_bad


def causal_selects(q: torch.Tensor, value_dim: int | None = None) -> bool:
    """Whether the causal call without a mask (`hpu.sdpa_final`) hides later keys' scores by selection, so a
    NaN there reaches no earlier row: torch SDPA's fused kernels (tested: the CPU's for equal key and value
    dims, CUDA's for 16-bit heads up to 256), not its math kernel (unequal dims: MLA's expanded prompts),
    which adds -inf to a NaN score; not known of FusedSDPA."""
    if value_dim is not None and value_dim != q.shape[-1]:
        return False
    cuda_ok = q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256
    return q.device.type == "cpu" or (q.device.type == "cuda" and cuda_ok)


def _causal_keys(q, k, v, batch):
    """Rows, keys, values `[P, Qp, H, D]` of prompts without context (views on a grid, else gathered) for
    that call: a new key whose key or value is not finite goes in as NaN, its value as zero (also past a
    prompt's tokens), so exactly the rows at or past it come out NaN; test and write fuse into one pass."""
    p, qp = batch.prompt_rows.shape
    if batch.plan.prompt_grid:
        qr, kr, vr = (x[: p * qp].view(p, qp, *x.shape[1:]) for x in (q, k, v))
    else:
        rows = batch.prompt_rows.clamp(max=q.shape[0] - 1)
        qr, kr, vr = q[rows], k[rows], v[rows]
    bad = ~fused.finite_heads(kr, vr)[..., None]  # [P, Qp, Hkv, 1]
    past = (torch.arange(qp, device=q.device)[None, :] >= batch.prompt_len[:, None])[..., None, None]
    nan, zero = (torch.full((), x, dtype=kr.dtype, device=q.device) for x in (float("nan"), 0.0))
    return qr, torch.where(bad, nan, kr), torch.where(bad | past, zero, vr)


def _positions(batch, keys: int, qp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The non-compact layout's `[P, Kp]` sequence position of each key and whether it is a real key:
    `keys` context slots (real below the prompt's context), then `qp` new keys (real below its count)."""
    pos = torch.arange(keys + qp, device=batch.prompt_ctx.device)[None, :]
    ctx, length = batch.prompt_ctx[:, None], batch.prompt_len[:, None]
    in_ctx = pos < keys
    return torch.where(in_ctx, pos, ctx + (pos - keys)), torch.where(in_ctx, pos < ctx, pos - keys < length)


def _mask(batch, seq: torch.Tensor, valid: torch.Tensor, qp: int) -> torch.Tensor:
    """`[P, 1, Qp, Kp]` True where row `i` of a prompt sees the key: a real key at or before its sequence
    position `ctx + i` (causal, bottom-right aligned)."""
    last = batch.prompt_ctx[:, None] + torch.arange(qp, device=seq.device)[None, :]  # [P, Qp]
    return ((seq[:, None, :] <= last[..., None]) & valid[:, None, :])[:, None]


def prompt_bias(batch, dtype: torch.dtype, same_head_dims: bool = True) -> torch.Tensor | None:
    """The final form's mask as the additive bias SDPA takes (0 visible, -inf not) in `dtype`, for the
    whole step (`UnifiedBatch.with_prompt_bias`); None when the batch has no prompt with context blocks
    (its call is causal with no mask). Split (`split_context`, which `same_head_dims` goes to): the
    context keys' padding bias alone."""
    blocks = getattr(batch, "prompt_blocks", None)
    if blocks is None or blocks.shape[0] == 0 or blocks.shape[1] == 0:
        return None
    if split_context(batch, same_head_dims):
        return _key_bias(batch, blocks.shape[1] * batch.block_size, dtype)
    qp = batch.prompt_rows.shape[1]
    seq, valid = _positions(batch, blocks.shape[1] * batch.block_size, qp)
    mask = _mask(batch, seq, valid, qp)
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))


def _key_bias(batch, keys: int, dtype: torch.dtype) -> torch.Tensor:
    """`[P, 1, 1, keys]`: 0 for the context slots below each prompt's context, -inf past it."""
    used = torch.arange(keys, device=batch.prompt_ctx.device)[None, :] < batch.prompt_ctx[:, None]
    return torch.zeros(used.shape, dtype=dtype, device=used.device).masked_fill(~used, float("-inf"))[:, None, None]


def _split_rows(qr, kall, vall, batch, scale) -> torch.Tensor:
    """The split form (`split_context`): `[P, Hq, Qp, D]` normalised rows; `kall`, `vall` (context
    `[P, Cb * bs, Hkv, D]`, new `[P, Qp, Hkv, D]`) pairs (`_keys` / `_clean_keys` with `split`).

    Two fused calls with statistics (`fused.sdpa_lse`): the context keys (the first `Cb * bs`) under the
    key-padding bias, the new keys `is_causal` (top-left: row i sees new keys 0..i) with no mask; then
    the exact merge by max and LSE in the compute dtype. A prompt with context 0 sees no context key:
    its context call's row is the kernel's choice (cuDNN: 0 with LSE -inf; the CPU's flash: 0 with LSE
    0), so it is selected away, not weighted. A NaN real context key still reaches every row of its
    prompt (through the LSE or the row)."""
    p, qp = qr.shape[:2]
    (kc, kn), (vc, vn) = ((a.transpose(1, 2), b.transpose(1, 2)) for a, b in (kall, vall))
    keys = kc.shape[2]
    q = qr.transpose(1, 2)
    bias = batch.prompt_bias
    if bias is None or bias.dtype != q.dtype or tuple(bias.shape) != (p, 1, 1, keys):
        bias = _key_bias(batch, keys, q.dtype)
    out_c, lse_c = fused.sdpa_lse(q, kc, vc, bias, scale)
    out_n, lse_n = fused.sdpa_lse(q, kn, vn, None, scale, causal=True)
    return merge_split(out_c, lse_c, out_n, lse_n, (batch.prompt_ctx > 0)[:, None, None])


def merge_split(out_c, lse_c, out_n, lse_n, has: torch.Tensor | None = None) -> torch.Tensor:
    """The split form's two calls (context, new keys: normalised rows `[P, Hq, Qp, D]` and LSEs
    `[P, Hq, Qp]`) merged exactly by max and LSE in the compute dtype, elementwise (a row's result is
    its own two rows'); `has` `[P, 1, 1]`: the prompts with context (None: all), whose context row counts."""
    if has is not None:
        lse_c = torch.where(has, lse_c, float("-inf"))
    top = torch.maximum(lse_c, lse_n)  # NaN stays NaN
    w_c, w_n = torch.exp(lse_c - top), torch.exp(lse_n - top)
    dt = lse_n.dtype
    ctx_part = out_c.to(dt) * w_c[..., None]
    if has is not None:
        ctx_part = torch.where(has[..., None], ctx_part, 0.0)
    return ((ctx_part + out_n.to(dt) * w_n[..., None]) / (w_c + w_n)[..., None]).to(out_n.dtype)


def prompt_partial(q, k, v, key_cache, value_cache, batch, scale, soft_cap, k_scale=None, v_scale=None) -> Partial:
    """The partial form: strict-causal pairs and context of every prompt row through the matmul tiles
    (`tiles.attend` masks unseen keys and contains bad values itself), merged into the step's rows."""
    n = q.shape[0]
    qr, kall, vall, valid, seq, _ = _keys(q, k, v, key_cache, value_cache, batch, k_scale, v_scale, compact=False)
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
    against its first `ctx + len` keys, causal bottom-right aligned: no mask at all. Else, with context
    blocks, the split form (`split_context`: two calls with statistics and a merge); else one SDPA call
    (`hpu.sdpa_final`: FusedSDPA on a Gaudi) over the padded batch, with the mask the layout needs (none
    without context; off a Gaudi then the call's rows as they come: `_causal_keys`)."""
    from vllm_gaudi_unified.hpu import sdpa_final

    value_dim = (v if context is None else context[1]).shape[-1]
    if not flash and context is None and not first and batch.prompt_blocks.shape[1] == 0 and causal_selects(q, value_dim):
        qr, kall, vall = (x.transpose(1, 2) for x in _causal_keys(q, k, v, batch))
        return sdpa_final(qr, kall, vall, None, scale).transpose(1, 2).reshape(-1, q.shape[1], value_dim)
    split = not flash and split_context(batch, value_dim == q.shape[-1] and fused.lse_kernel_for(q))
    # (split: only where a kernel returns the statistics, never a matmul over every score)
    if not flash and context is None and not first and key_cache is not None and not is_fp8(key_cache.dtype):
        qr, kall, vall, valid, seq, new_bad = _clean_keys(q, k, v, key_cache, value_cache, batch, split)
    else:
        qr, kall, vall, valid, seq, new_bad = _keys(q, k, v, key_cache, value_cache, batch, k_scale, v_scale,
                                                    compact=flash, clean=True, context=context, first=first,
                                                    split=split)
    p, qp, hq, d = qr.shape
    hkv = k.shape[1]
    i = torch.arange(qp, device=q.device)
    if flash:
        out = _flash_rows(qr, kall, vall, batch, scale)
    elif split:
        out = _split_rows(qr, kall, vall, batch, scale).transpose(1, 2).reshape(p * qp, hq, d)
    else:
        mask = None  # (none without context: causal)
        if batch.prompt_blocks.shape[1]:  # the step's bias when made for this dtype and shape, else made here
            bias = batch.prompt_bias
            full = bias is not None and bias.dtype == qr.dtype and bias.shape[2:] == (qp, kall.shape[1])
            mask = bias if full else _mask(batch, seq, valid, qp)
        out = sdpa_final(qr.transpose(1, 2), kall.transpose(1, 2), vall.transpose(1, 2), mask, scale)
        out = out.transpose(1, 2).reshape(p * qp, hq, vall.shape[-1])  # MLA: values narrower than keys
    # rows that see a bad new key: those at or past the first one (a reduction over the new keys, no scan)
    first_bad = torch.where(new_bad, i[None, :, None], qp).amin(1)  # [P, Hkv]
    seen = first_bad[:, None, :] <= i[None, :, None]  # [P, Qp, Hkv]
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


def grid_rows(values: torch.Tensor, batch, n: int) -> torch.Tensor:
    """The `n` output rows of a step whose prompts are the grid of its rows (`plan.prompt_grid`): the
    prompt route's `[P * Qp]` rows where they are, zero past each prompt's tokens and past the grid.
    Elementwise, so the compiled function writes it in the pass that marks the rows (no gather); none on a
    full grid (`StepPlan.prompt_full`) off a Gaudi (`causal_selects`: nothing to zero)."""
    p, qp = batch.prompt_rows.shape
    if causal_selects(values) and p * qp == n and batch.plan.prompt_full:  # (on a Gaudi no guard on the shape)
        return values
    real = (torch.arange(qp, device=values.device)[None, :] < batch.prompt_len[:, None]).reshape(-1, 1, 1)
    out = torch.where(real, values, torch.zeros((), dtype=values.dtype, device=values.device))
    return out if p * qp == n else torch.cat([out, out.new_zeros((n - p * qp,) + out.shape[1:])])


def write_rows(out: torch.Tensor | None, rows: torch.Tensor, values: torch.Tensor, n: int = 0) -> torch.Tensor:
    """`out` `[n, Hq, D]` with `values` written at `rows` (`n` = no row: dropped); `out` None: the `n`
    rows of a step of prompts alone (no other path wrote anything), zero where no value lands.

    Without `out` the rows are gathered, not scattered: each output row reads its value through the
    inverse of `rows` (a scatter of `[P * Qp]` indices), so the compiled function writes the output
    once, in one pass with the ops that made `values`, instead of zeroing it and scattering into it."""
    if out is None:
        m = rows.numel()
        src = torch.full((n + 1,), m, dtype=rows.dtype, device=rows.device)
        src = src.index_copy_(0, rows.reshape(-1), torch.arange(m, device=rows.device, dtype=rows.dtype))[:n]
        got = (src < m)[:, None, None]
        return torch.where(got, values[src.clamp(max=m - 1)], torch.zeros((), dtype=values.dtype,
                                                                          device=values.device))
    n = out.shape[0]
    full = torch.cat([out, out.new_zeros((1,) + out.shape[1:])])
    return full.index_copy_(0, rows.reshape(-1), values.to(full.dtype))[:n]
