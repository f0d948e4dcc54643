"""Partial softmax results and their exact merge: the one place that defines the convention.

A `Partial` is what a path knows about each (query row, head) after seeing some
of its keys, in natural-log units and the compute dtype (fp32, or fp64 for fp64
inputs)::

    max = max_k s_k              # -inf when the row saw no key
    sum = sum_k e^(s_k - max)    # 0 when the row saw no key
    acc = sum_k e^(s_k - max) v_k

Merging is exact: rescale each side to the larger max and add. A row that saw
no key contributes exactly zero, whatever its `acc` holds, so an absent path or
a fully masked row never produces NaN; a row that met a NaN (a bad value it may
see) keeps it, for its own token alone. `merge_all` is a fold over `merge` in a given order;
`fold_pairwise` the same over slots in a fixed tree (the batch-invariant mode);
`scatter_merge` the same merge when many rows (tiles, blocks) feed one destination token.
`normalize` turns the merged Partial into the rows; a path that is a step's only one may return its rows
already normalized (`Final`), and then nothing here runs. `sink_partial`: an attention sink as a Partial.

`merge_rows` is `normalize(merge_all(...))` for a step whose tile paths hand their rows unmerged
(`Scattered`): every path's rows are scaled once to the step's max and added into one accumulator, so a
token row (a bucket's padding rows included) pays one zeroed row and its normalize, not a dense Partial per
path and the passes of each `merge` over them.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import torch


class Partial(NamedTuple):
    acc: torch.Tensor  #: [rows, num_qo_heads, head_dim] unnormalised weighted values
    max: torch.Tensor  #: [rows, num_qo_heads] running max of the scores (-inf: no key seen)
    sum: torch.Tensor  #: [rows, num_qo_heads] sum of e^(score - max) (0: no key seen)


class Final(NamedTuple):
    """A step's rows already normalized, in the output dtype: what a path writes when it is the step's only one
    (`mla_decode.kernel_mla_partial(final=True)`, `unique.kernel_unique_partial(final=True)`), so no merge or
    normalize pass reads its rows again (an H100 decode step at DeepSeek-V3's shapes spent 45 us of 400 there)."""
    out: torch.Tensor  #: [rows, num_qo_heads, head_dim_v]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """A Partial's dtype for inputs of `dtype`: fp32 for fp16/bf16/fp32, fp64 kept (the reference checks)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def rescale_weights(old_max: torch.Tensor, new_max: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(seen, w): rows that saw a key (max != -inf; a NaN max counts as seen: a row that met a bad value keeps
    it, its own token only) and their rescale e^(max - new_max), 1 where unseen (no inf - inf)."""
    seen = old_max != float("-inf")
    return seen, torch.exp(torch.where(seen, old_max - new_max, 0.0))


def rescaled(x: torch.Tensor, seen: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x * w, exactly 0 where unseen whatever x holds (a NaN there would survive a multiplication by 0);
    `out`: written there (the `where` writes its result in place of a copy)."""
    if x.dim() > seen.dim():
        seen, w = seen[..., None], w[..., None]
    if out is None:
        return torch.where(seen, x * w, 0.0)
    return torch.where(seen, x * w, w.new_zeros(()), out=out)


def _scaled(p: Partial, new_max: torch.Tensor, out: tuple = (None, None)) -> tuple[torch.Tensor, torch.Tensor]:
    """(acc, sum) of `p` rescaled to `new_max` (`rescaled`), into `out` where given."""
    seen, w = rescale_weights(p.max, new_max)
    return rescaled(p.acc, seen, w, out[0]), rescaled(p.sum, seen, w, out[1])


def merge(a: Partial, b: Partial) -> Partial:
    m = torch.maximum(a.max, b.max)
    (acc_a, sum_a), (acc_b, sum_b) = _scaled(a, m), _scaled(b, m)
    return Partial(acc_a + acc_b, m, sum_a + sum_b)


def merge_all(partials: Sequence[Partial]) -> Partial:
    """Fold in the given order (the order matters only for floating-point rounding)."""
    out = partials[0]
    for p in partials[1:]:
        out = merge(out, p)
    return out


def fold_pairwise(slots: Partial) -> Partial:
    """Merge `[rows, width, ...]` slots (width a power of two) into `[rows, ...]` by a fixed pairwise
    tree: halves, then halves again. Empty slots merge exactly, so padding the width changes nothing."""
    acc, m, s = slots
    w = m.shape[1]
    while w > 1:
        h = w // 2
        acc, m, s = merge(Partial(acc[:, :h], m[:, :h], s[:, :h]), Partial(acc[:, h:], m[:, h:], s[:, h:]))
        w = h
    return Partial(acc[:, 0], m[:, 0], s[:, 0])


#: Destinations x rows x heads up to which `scatter_max` is one masked reduction (dense ops an HPU graph or
#: one fused kernel runs) instead of a scatter with a max (a slow general op on a Gaudi, an aten fallback
#: kernel under torch.compile).
DENSE_MAX_WORK = 1 << 21


def dense_max(destinations: int, rows_max: torch.Tensor) -> bool:
    """Whether `scatter_max` of `rows_max` into `destinations` rows takes the dense form (`DENSE_MAX_WORK`)."""
    return 0 < destinations * rows_max.numel() <= DENSE_MAX_WORK


def scatter_max(rows_max: torch.Tensor, index: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
    """`start` `[num_out + 1, heads]` with row i's max `rows_max[i]` taken in at `index[i]` (`num_out`: drop).
    A max is exact in any order: both forms give the same values (a NaN row's token gets NaN, no other)."""
    index = index.reshape(-1)
    if dense_max(start.shape[0], rows_max):
        hit = index == torch.arange(start.shape[0], device=index.device, dtype=index.dtype)[:, None]  # [out, rows]
        return torch.maximum(start, torch.where(hit[:, :, None], rows_max, float("-inf")).amax(1))
    idx = index[:, None].expand(-1, rows_max.shape[1])
    return start.scatter_reduce(0, idx, rows_max, reduce="amax", include_self=True)


def scatter_merge(rows: Partial, index: torch.Tensor, num_out: int) -> Partial:
    """Merge rows into `num_out` destinations; `index[i]` is row i's destination, `num_out` = drop."""
    heads = rows.max.shape[1]
    start = torch.full((num_out + 1, heads), float("-inf"), dtype=rows.max.dtype, device=rows.max.device)
    new_max = scatter_max(rows.max, index, start)
    row_acc, row_sum = _scaled(rows, new_max.gather(0, index.reshape(-1, 1).expand(-1, heads)))
    acc = torch.zeros((num_out + 1,) + rows.acc.shape[1:], dtype=row_acc.dtype, device=rows.acc.device)
    acc = acc.index_add(0, index, row_acc)
    total = torch.zeros_like(new_max).index_add(0, index, row_sum)
    return Partial(acc[:num_out], new_max[:num_out], total[:num_out])


class Scattered(NamedTuple):
    """A path's rows before `scatter_merge`: `rows` (a Partial of tile rows) and `index`, each row's token
    (the step's row count: none). `merge_rows` takes them as they are."""
    rows: Partial
    index: torch.Tensor


def merge_rows(parts: Sequence[Partial | Scattered], rows: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`normalize(merge_all(...), dtype)` of `[rows]` Partials and `Scattered` rows in one accumulator: the
    step's max per token (the Partials' and the scattered rows' `scatter_max`), then each part scaled to it
    (`_scaled`: a row that saw no key adds exactly 0) and added in order, the scattered rows by `index_add`.
    The same exact merge, rounded once per part instead of once per path and again per `merge`."""
    if not any(isinstance(p, Scattered) for p in parts):
        return normalize(merge_all(parts), dtype)
    start = not isinstance(parts[0], Scattered)  # a Partial first: its scaled rows start the sums (no zeroed pass)
    some = parts[0] if start else parts[0].rows
    heads, dim = some.acc.shape[1:]
    new_max = some.max.new_full((rows + 1, heads), float("-inf"))  # (row `rows`: the dropped rows')
    for p in parts:
        if isinstance(p, Scattered):
            new_max = scatter_max(p.rows.max, p.index, new_max)
        else:
            new_max[:rows] = torch.maximum(new_max[:rows], p.max)
    acc, total = new_max.new_empty((rows + 1, heads, dim)), new_max.new_empty((rows + 1, heads))
    if start:  # a Partial first: its scaled rows written where the sums are
        p, parts = parts[0], parts[1:]
        _scaled(p, new_max[:rows], out=(acc[:rows], total[:rows]))
    for x in (acc, total):
        (x[rows:] if start else x).zero_()
    for p in parts:
        if isinstance(p, Scattered):
            index = p.index.reshape(-1)
            row_acc, row_sum = _scaled(p.rows, new_max.gather(0, index[:, None].expand(-1, heads)))
            acc.index_add_(0, index, row_acc)
            total.index_add_(0, index, row_sum)
        else:
            row_acc, row_sum = _scaled(p, new_max[:rows])
            acc[:rows] += row_acc
            total[:rows] += row_sum
    return normalize(Partial(acc[:rows], new_max[:rows], total[:rows]), dtype)


def normalize(p: Partial, dtype: torch.dtype | None = None) -> torch.Tensor:
    """acc / sum in `dtype` (default acc's); a row that saw no key (only possible for padding rows) gives 0.
    The quotient is written in `dtype` by the division itself: no second pass to convert (an H100 decode step
    spent 15 us of 50 in that pass)."""
    denom = torch.where(p.sum > 0, p.sum, 1.0)[..., None]
    if dtype is None or dtype == torch.promote_types(p.acc.dtype, denom.dtype):  # (a 16-bit acc: the self pair)
        return p.acc / denom
    return torch.div(p.acc, denom, out=torch.empty(p.acc.shape, dtype=dtype, device=p.acc.device))


def sink_partial(sinks: torch.Tensor, rows: int, head_dim: int, dtype: torch.dtype) -> Partial:
    """A sink is a key with logit `sinks[h]` and a zero value: weight in the denominator only.

    +inf is taken as the largest finite logit: all the weight, and no `inf - inf` in the merge."""
    m = sinks.to(dtype).clamp(max=torch.finfo(dtype).max)[None, :].expand(rows, -1)
    return Partial(torch.zeros(rows, sinks.shape[0], head_dim, dtype=dtype, device=sinks.device), m,
                   torch.ones_like(m))
