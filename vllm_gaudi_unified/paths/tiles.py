"""The one computation every path repeats: a batch of query-row tiles against key tiles.

Each path gathers its rows and keys into `[tiles, rows, heads, head_dim]` /
`[tiles, keys, kv_heads, head_dim]`, builds a boolean mask, and calls `attend`,
which returns one `Partial` row per (tile, row). GQA is done by grouping query
heads per KV head inside the matmul, so K/V are never repeated in memory.

Precision and bytes: the two matmuls take the inputs' own dtype (bf16 tensor
cores, fp32 accumulation inside), so K/V are never copied up to fp32 on CUDA;
the scores leave their product in fp32 but on a Gaudi (`score_product`); scores,
max, sum and the merged accumulators are in the compute dtype (fp32, fp64 for
fp64 inputs). Probabilities are rounded to the value dtype for `p @ V`, as
flash attention does. fp16 is the exception: its range ends at 65504, so a
score `q . k` or a sum `p @ V` over many keys can overflow where the float64
result is small; fp16 operands are taken up to fp32 for both products
(`product_dtype`). bf16 has fp32's range and keeps its own.

Bad values stay with the rows that see them. A key no row of a tile may see is
zeroed in V; a key that some rows see and whose value is not finite (NaN, inf:
an overflow upstream) is zeroed too, and the scores of exactly the rows that
see it become NaN (`clean_values`, `mask_scores`). Otherwise `0 * NaN` in
`p @ V` would turn every row of the tile NaN, other requests' rows included.

Tiles of one row (the unique path: one decode token per block) are bound by
reading K/V, not by arithmetic. There both products run over the block as
stored, `[keys * kv_heads, head_dim]`: the scores of every (query head, KV
head) pair are computed and the matching ones kept, and `p @ V` takes a
probability matrix that is zero off the matching heads. K and V are read in
place instead of being transposed into a per-head layout, for kv_heads times
the (free) arithmetic. When the caller lists the tiles that miss some key
(the unique path: a request's partial last block), V is masked on those
tiles alone rather than copied whole through the masking pass.

The shared path's tiles take `attend_heads`: q, K and V copied once each into
the products' head-major layout (no transposed copy of K; V cleaned in its
copy; the scale folded into q's), and one fused softmax in the scores' dtype
(16-bit on a Gaudi) in place of the mask, max, subtract, exp and sum passes.
"""
from __future__ import annotations

import torch

from vllm_gaudi_unified.hpu import masked_softmax_for
from vllm_gaudi_unified.merge import Partial, compute_dtype
from vllm_gaudi_unified.paths import fused


def slot_mask(lo: torch.Tensor, hi: torch.Tensor, block_size: int) -> torch.Tensor:
    """`[..., block_size]` True for slots in `[lo, hi)` (a token's visible slots of one cache block)."""
    slot = torch.arange(block_size, device=lo.device)
    return (slot >= lo[..., None]) & (slot < hi[..., None])


def product_dtype(dtype: torch.dtype) -> torch.dtype:
    """Operand dtype of the two products: fp16 goes up to fp32 (its range overflows at 65504), others stay."""
    return torch.float32 if dtype == torch.float16 else dtype


def score_product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`a @ b` (the same batch dims) in the compute dtype. 16-bit operands keep their dtype in the product
    (tensor cores, fp32 accumulation) but not in its output, as flash keeps its scores: a bf16 score is off
    by up to 2^-9 of itself, 0.5 at |q . k| ~ 256 (DeepSeek's 576-dim latent), a logit error of 0.036
    after the scale, which moves a row by more than the output's own bf16 rounding. On CUDA the product
    writes fp32 (`bmm`'s `out_dtype`); on the CPU the operands go up to fp32; a Gaudi keeps the
    product's dtype (its fp32 matmul runs at a fraction of the bf16 rate), and so does CUDA on the Gaudi
    route (`fused.gaudi_route()`), so that it runs, times and holds what a Gaudi does."""
    dt = compute_dtype(a.dtype)
    if a.dtype == dt or gaudi_product(a.device.type):
        return torch.matmul(a, b)
    if a.device.type != "cuda":
        return torch.matmul(a.to(dt), b.to(dt))
    out = torch.bmm(a.reshape(-1, *a.shape[-2:]), b.reshape(-1, *b.shape[-2:]), out_dtype=dt)
    return out.view(*a.shape[:-1], b.shape[-1])


def gaudi_product(device_type: str) -> bool:
    """A Gaudi's product dtype: an HPU tensor, or a CUDA one on the Gaudi route (`fused.CUDA_KERNELS` off)."""
    return device_type == "hpu" or (device_type == "cuda" and not fused.CUDA_KERNELS)


def written(out: torch.Tensor, op, *args) -> torch.Tensor:
    """`op(*args, out=out)`, in `out`'s layout: eager, the op writes there (one pass); compiled, `out.copy_(op(*args))`,
    one fused pass too. (Compiled, an `out=` write into a buffer made in the function takes the result's strides
    instead, torch 2.11's functionalization, and a later `view` of the buffer fails.)"""
    if torch.compiler.is_compiling():
        return out.copy_(op(*args))
    return op(*args, out=out)


def clean_values(v: torch.Tensor, seen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """v `[T, K, Hkv, D]`, seen `[T, K]` (some row of the tile sees the key) ->
    (v with unseen keys and non-finite values set to 0, as contiguous `[T, Hkv, K, D]`;
    bad `[T, Hkv, K]`: seen keys whose value is not finite)."""
    t, k, hkv, d = v.shape
    finite = fused.finite_rows(v)  # [T, K, Hkv]
    keep = seen[:, :, None] & finite
    out = torch.empty((t, hkv, k, d), dtype=v.dtype, device=v.device)
    written(out, torch.where, keep.permute(0, 2, 1)[..., None], v.permute(0, 2, 1, 3),
            torch.zeros((), dtype=v.dtype, device=v.device))
    return out, (seen[:, :, None] & ~finite).permute(0, 2, 1)


def mask_scores(scores: torch.Tensor, mask: torch.Tensor, bad: torch.Tensor) -> torch.Tensor:
    """Scores `[T, Hkv, G, R, K]`: -inf where the row may not see the key, NaN where it sees a bad value
    (`bad` `[T, Hkv, K]` from `clean_values`), so that row alone carries the NaN."""
    visible = mask[:, None, None]  # [T, 1, 1, R, K]
    nan = torch.full((), float("nan"), dtype=scores.dtype, device=scores.device)
    scores = torch.where(visible & bad[:, :, None, None, :], nan, scores)
    return scores.masked_fill(~visible, float("-inf"))


def scores_to_partial(scores: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                      bad: torch.Tensor | None = None) -> Partial:
    """Scores `[T, Hkv, G, R, K]`, values `[T, Hkv, K, D]` (cleaned, see `clean_values`) and mask
    -> Partial rows `[T*R, Hkv*G, D]`."""
    t, hkv, g, r, k = scores.shape
    if bad is None:
        scores = scores.masked_fill(~mask[:, None, None], float("-inf"))
    else:
        scores = mask_scores(scores, mask, bad)
    p, m, total = masked_softmax_for(scores)(scores)
    acc = torch.matmul(p.to(v.dtype).reshape(t, hkv, g * r, k), v).to(scores.dtype).reshape(t, hkv, g, r, -1)
    as_rows = lambda x: x.permute(0, 3, 1, 2, *range(4, x.dim())).reshape(t * r, hkv * g, *x.shape[4:])
    return Partial(as_rows(acc), as_rows(m), as_rows(total))


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
           soft_cap: float | None, masked_tiles: torch.Tensor | None = None, stacked: bool = False) -> Partial:
    """q `[T, R, Hq, D]`, k `[T, K, Hkv, D]`, v `[T, K, Hkv, Dv]` (MLA: Dv < D), mask `[T, R, K]`
    (True = visible) -> Partial `[T*R, Hq, Dv]`.

    Keys no row of a tile may see are zeroed in `v` first: a poisoned cache slot
    (NaN, inf) times a zero probability would still be NaN; a non-finite value
    some rows see reaches those rows alone (module docstring). `masked_tiles`
    (one-row tiles): indices of every tile whose real rows may miss
    some key; then only those tiles are masked, and the others (all keys seen,
    or no row: their partial may hold NaN, for the merge to drop) read V as is.
    `stacked` (with `masked_tiles` empty,
    V's unseen keys zeroed by the caller): rows that see the same keys (a verify unit's tokens; no-rows
    see none) take the one-row form with the rows stacked in its two products.
    """
    t, r, hq, d = q.shape
    nk, hkv = k.shape[1], k.shape[2]
    g = hq // hkv
    dt = compute_dtype(q.dtype)
    op = product_dtype(q.dtype)
    q, k, v = q.to(op), k.to(op), v.to(op)  # no-ops but for fp16
    if (r == 1 or stacked) and hkv > 1 and k.is_contiguous() and v.is_contiguous():
        return _attend_one_row(q, k, v, mask, scale, soft_cap, masked_tiles)
    qg = q.view(t, r, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(t, hkv, g * r, d)  # [T, Hkv, G*R, D]
    kt = k.permute(0, 2, 3, 1)  # [T, Hkv, D, K]
    if hkv > 1:  # one layout at every tile count: the product folds T and Hkv, a view of kt for one tile and a
        kt = kt.contiguous()  # copy for more, whose bits differ (a bucket's padding tile changed real rows)
    scores = score_product(qg, kt).view(t, hkv, g, r, nk)
    scores = scores.to(dt) * scale
    if soft_cap is not None:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    v, bad = clean_values(v, mask.any(1))
    return scores_to_partial(scores, v, mask, bad)


def _attend_one_row(q, k, v, mask, scale, soft_cap, masked_tiles=None) -> Partial:
    """`attend` for one-row tiles, K/V as stored `[T, K, Hkv, D]` (see the module docstring); several rows
    (`attend`'s `stacked`: they see the same keys, `masked_tiles` empty) stacked in the two products, the
    rest on `[T * R, ...]` as for one-row tiles."""
    return _one_row_values(*_one_row_probs(q, k, mask, scale, soft_cap), v, masked_tiles)


def _one_row_probs(q, k, mask, scale, soft_cap):
    """The one-row form's first half: (probabilities `[T, R*Hq, K*Hkv]` zero off a row's heads, max, sum,
    visible `[T*R, K]`). Nothing of K is held after it (the scores of every head pair freed too)."""
    t, r, hq, d = q.shape
    nk, hkv = k.shape[1], k.shape[2]
    g, tr = hq // hkv, t * r
    every = score_product(q.reshape(t, r * hq, d), k.reshape(t, nk * hkv, d).transpose(1, 2))  # [T, R*Hq, K*Hkv]
    scores = torch.diagonal(every.view(tr, hkv, g, nk, hkv), dim1=1, dim2=4)  # [TR, G, K, Hkv]: head h vs h // g
    scores = scores.permute(0, 3, 1, 2).to(compute_dtype(q.dtype))  # [TR, Hkv, G, K]
    del every  # (freed here where the line above copied: a product kept in 16 bits, a Gaudi's)
    scores = scores * scale
    if soft_cap is not None:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    visible = mask.reshape(tr, nk)  # [TR, K]
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    p, m, total = masked_softmax_for(scores)(scores)
    del scores
    p_every = torch.zeros((t, r * hq, nk * hkv), dtype=k.dtype, device=k.device)
    torch.diagonal(p_every.view(tr, hkv, g, nk, hkv), dim1=1, dim2=4).copy_(p.permute(0, 2, 3, 1))
    return p_every, m.reshape(tr, hq), total.reshape(tr, hq), visible


def _one_row_values(p_every, m, total, visible, v, masked_tiles=None) -> Partial:
    """The one-row form's second half: `p @ V` over V as stored `[T, K, Hkv, Dv]`, masked as `attend` says."""
    t, rhq, nkh = p_every.shape
    tr, hq, dv = m.shape[0], m.shape[1], v.shape[-1]
    dt = m.dtype
    zero = torch.zeros((), dtype=v.dtype, device=v.device)
    if masked_tiles is None:
        vz = torch.where(visible[:, :, None, None], v, zero)
        acc = torch.matmul(p_every, vz.view(t, nkh, dv)).view(tr, hq, dv).to(dt)
    else:  # V as stored, then the few tiles that miss a key again on masked V (one pass less over V)
        acc = torch.matmul(p_every, v.view(t, nkh, dv)).view(tr, hq, dv)
        sel = masked_tiles
        if sel.shape[0]:  # (none: the caller zeroed V's unseen keys itself)
            vz = torch.where(visible[sel][:, :, None, None], v[sel], zero)
            # Fixed in the product's own dtype, so the cast to fp32 stays fused into the merge that reads it.
            acc = acc.index_copy_(0, sel, torch.matmul(p_every[sel].view(-1, hq, nkh), vz.view(-1, nkh, dv)))
        acc = acc.to(dt)
    return Partial(acc, m, total)


def attend_gathered(q, read_k, read_v, mask, scale, soft_cap) -> Partial:
    """`attend(q, read_k(), read_v(), ..., masked_tiles=<none>, stacked=True)` (the tile's rows see the same
    keys; `read_v` zeroes the keys no row sees), where in the one-row form V is gathered only once the
    scores are taken and K is freed: a call holds one of its two gathers at a time. The same products, in
    the same order, on the same values: the same bits."""
    none = torch.zeros(0, dtype=torch.int64, device=q.device)
    k = read_k()
    if k.shape[2] == 1:  # one KV head: `attend`'s per-head form
        return attend(q, k, read_v(), mask, scale, soft_cap, masked_tiles=none, stacked=True)
    op = product_dtype(q.dtype)
    probs = _one_row_probs(q.to(op), k.to(op), mask, scale, soft_cap)
    del k
    return _one_row_values(*probs, read_v().to(op), none)  # gathers are contiguous, as the one-row form needs


def attend_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                 soft_cap: float | None) -> Partial:
    """`attend`'s multi-row tiles in fewer passes (shapes as `attend`'s): q, K and V copied once each into the
    products' own head-major layout `[Hkv, T, ...]` (the scale folded into q's copy where the product keeps
    q's dtype, V's copy cleaned on the way: keys no row sees and non-finite values zeroed), so neither product
    takes a transposed or per-head copy; then one fused softmax over the scores in the product's dtype
    (16-bit on a Gaudi) instead of fp32 passes for the mask, max, subtract, exp and sum. The row's largest
    probability is `1 / sum e^(s - max)`: the partial is `(acc / p_max, max, 1 / p_max)`. A row that sees
    a non-finite value gets a NaN max (the merge keeps it: its token alone); a row that sees no key has
    max -inf and sum 0 (its acc is NaN: the merge drops it, whatever it holds)."""
    t, r, hq, d = q.shape
    nk, hkv, dv = k.shape[1], k.shape[2], v.shape[-1]
    g = hq // hkv
    dt = compute_dtype(q.dtype)
    op = product_dtype(q.dtype)
    q, k, v = q.to(op), k.to(op), v.to(op)  # no-ops but for fp16
    heads = lambda x: x.permute(2, 0, 1, *range(3, x.dim()))  # [T, K, Hkv, ...] -> [Hkv, T, K, ...]  # noqa: E731
    fold = soft_cap is None and (q.dtype == dt or gaudi_product(q.device.type))
    qh = torch.empty((hkv, t, r, g, d), dtype=q.dtype, device=q.device)
    qv = q.view(t, r, hkv, g, d).permute(2, 0, 1, 3, 4)
    written(qh, torch.mul, qv, scale) if fold else qh.copy_(qv)
    kh = torch.empty((hkv, t, nk, d), dtype=k.dtype, device=k.device).copy_(heads(k))
    finite = fused.finite_rows(v)  # [T, K, Hkv]
    vh = torch.empty((hkv, t, nk, dv), dtype=v.dtype, device=v.device)
    written(vh, torch.where, heads(finite & mask.any(1)[:, :, None])[..., None], heads(v), v.new_zeros(()))
    # Rows that see a non-finite value, `[T, R, Hkv]`: a count of them as one product of the mask and the bad keys
    # (compiled, `(mask & bad).any(-1)` took each key's finiteness again for every row: 12.6 of 87 us, H200)
    bad_rows = torch.matmul(mask.to(q.dtype), (~finite).to(q.dtype)) > 0
    scores = score_product(qh.view(hkv * t, r * g, d), kh.view(hkv * t, nk, d).transpose(1, 2))
    if not fold:
        scores = scores.to(dt) * scale
        if soft_cap is not None:
            scores = soft_cap * torch.tanh(scores / soft_cap)
    scores = scores.view(hkv, t, r, g, nk).masked_fill_(~mask[None, :, :, None, :], float("-inf"))
    m = scores.amax(-1).to(dt)  # [Hkv, T, R, G]
    p = torch.softmax(scores, -1)
    p_max = p.amax(-1).to(dt)
    acc = torch.matmul(p.to(v.dtype).view(hkv * t, r * g, nk), vh.view(hkv * t, nk, dv)).view(hkv, t, r, g, dv)
    as_rows = lambda x: x.permute(1, 2, 0, 3, *range(4, x.dim()))  # [T, R, Hkv, G, ...]  # noqa: E731
    out = torch.empty((t, r, hkv, g, dv), dtype=dt, device=q.device)
    written(out, torch.div, as_rows(acc), as_rows(p_max)[..., None])
    seen = m != float("-inf")
    m = torch.where(heads(bad_rows)[..., None], float("nan"), m)
    total = torch.where(seen, 1 / p_max, 0.0)
    return Partial(out.view(t * r, hq, dv), *(as_rows(x).reshape(t * r, hq) for x in (m, total)))
