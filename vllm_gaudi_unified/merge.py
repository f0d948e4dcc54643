"""Partial softmax results and their exact merge: the one place that defines the convention.

A `Partial` is what a path knows about each (query row, head) after seeing some
of its keys, in natural-log units and the compute dtype (fp32, or fp64 for fp64
inputs)::

    max = max_k s_k              # -inf when the row saw no key
    sum = sum_k e^(s_k - max)    # 0 when the row saw no key
    acc = sum_k e^(s_k - max) v_k

Merging is exact: rescale each side to the larger max and add. A row that saw
no key has zero weight on every side, so an absent path or a fully masked row
never produces NaN. `merge_all` is a fold over `merge` in a given order;
`fold_pairwise` the same over slots in a fixed tree (the batch-invariant mode);
`scatter_merge` the same merge when many rows (tiles, blocks) feed one destination token.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import torch


class Partial(NamedTuple):
    acc: torch.Tensor  #: [rows, num_qo_heads, head_dim] unnormalised weighted values
    max: torch.Tensor  #: [rows, num_qo_heads] running max of the scores (-inf: no key seen)
    sum: torch.Tensor  #: [rows, num_qo_heads] sum of e^(score - max) (0: no key seen)


def _weight(m: torch.Tensor, new_max: torch.Tensor) -> torch.Tensor:
    """e^(m - new_max), and 0 where the side saw no key (m = -inf)."""
    seen = m > float("-inf")
    return torch.where(seen, torch.exp(torch.where(seen, m - new_max, 0.0)), 0.0)


def merge(a: Partial, b: Partial) -> Partial:
    m = torch.maximum(a.max, b.max)
    wa, wb = _weight(a.max, m), _weight(b.max, m)
    return Partial(a.acc * wa[..., None] + b.acc * wb[..., None], m, a.sum * wa + b.sum * wb)


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


def scatter_merge(rows: Partial, index: torch.Tensor, num_out: int) -> Partial:
    """Merge rows into `num_out` destinations; `index[i]` is row i's destination, `num_out` = drop."""
    heads = rows.max.shape[1]
    idx = index.reshape(-1, 1).expand(-1, heads)
    new_max = torch.full((num_out + 1, heads), float("-inf"), dtype=rows.max.dtype, device=rows.max.device)
    new_max = new_max.scatter_reduce(0, idx, rows.max, reduce="amax", include_self=True)
    w = _weight(rows.max, new_max.gather(0, idx))
    acc = torch.zeros((num_out + 1,) + rows.acc.shape[1:], dtype=rows.acc.dtype, device=rows.acc.device)
    acc = acc.index_add(0, index, rows.acc * w[..., None])
    total = torch.zeros_like(new_max).index_add(0, index, rows.sum * w)
    return Partial(acc[:num_out], new_max[:num_out], total[:num_out])


def normalize(p: Partial) -> torch.Tensor:
    """acc / sum; a row that saw no key (only possible for padding rows) gives 0."""
    return p.acc / torch.where(p.sum > 0, p.sum, 1.0)[..., None]
