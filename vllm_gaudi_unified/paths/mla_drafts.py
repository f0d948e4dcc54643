"""MLA's verify step: the drafts' causal pairs taken by the latent route that reads each request's blocks once.

In a verify step (`StepPlan.drafts_in_units`: every request off the prompt
route has at most `PlanOptions.unique_tokens` new tokens, its last token and
its drafts) a token's causal pairs are few: token t of a request whose first
new token is s sees the new keys s..t, at most `units` of them, in order of
position. On the generic paths they are causal tiles, each writing a fp32
Partial `[tokens, 128, 512]` at DeepSeek's shapes that is then merged with the
unique route's; that merge and its passes cost more than the latent kernel
(H200, 128 x (2 over 4k): 1.06 of 1.62 ms). Here they are one small batched
product per step, `[n, H, D] @ [n, D, units]` against each token's window of
`units` new keys (-inf where a key is another request's or comes after the
token), and the route folds them in as more keys of the token:

* 'chunks' (`mla_chunks.py`, the Gaudi route): they start the token's max and sums, as its own key did;
* 'kernel' (CUDA): the kernels take them inside (`mla_kernel.py`, `mla_gluon_seesaw.py`: `UNITS`, split 0 of a
  token starting from its own and earlier new keys); `fold_drafts` adds them after the kernel where that is off
  (`mla_decode.MLA_KERNEL_DRAFTS`) or the step reads no cached key.
"""
from __future__ import annotations

import torch

from vllm_gaudi_unified.merge import Final, Partial
from vllm_gaudi_unified.paths.mla_shared import finite_shift, latent_scores
from vllm_gaudi_unified.paths.tiles import compute_dtype


def draft_scores(q: torch.Tensor, key: torch.Tensor, batch, scale: float, units: int, strict: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token against the new keys `t - units + 1 .. t` of its request (`strict`: `.. t - 1`, its own key
    left to the caller): (scores `[n, H, units]` in the compute dtype, rounded as the latent products round
    theirs, -inf where not seen; those keys `[n, units, D]`, zero where not seen). `key`: `[n, 1, D]`."""
    n = q.shape[0]
    t = torch.arange(n, device=q.device)
    idx = t[:, None] + torch.arange(1 - units, 1 - int(strict), device=q.device)  # [n, units (- 1)]
    seen = idx >= batch.token_seg_start[:n, None]
    keys = torch.where(seen[..., None], key[idx.clamp(min=0), 0], torch.zeros((), dtype=key.dtype, device=key.device))
    s = latent_scores(q, keys, None, scale).to(compute_dtype(q.dtype))  # [n, H, units]
    return s.masked_fill(~seen[:, None, :], float("-inf")), keys


def fold_drafts(part: Partial, q: torch.Tensor, key: torch.Tensor, batch, scale: float, value_dim: int, units: int,
                final: bool) -> Partial | Final:
    """`part` (rows that hold each token's own pair and its cached keys) with the token's earlier drafts
    (`draft_scores(strict=True)`) added; `final`: normalized in q's dtype."""
    s, keys = draft_scores(q, key, batch, scale, units, strict=True)
    top = torch.maximum(part.max, s.amax(-1))
    shift = finite_shift(top)
    a = torch.exp(part.max - shift)  # (0 where the row saw nothing)
    w = torch.exp(s - shift[..., None])  # [n, H, units - 1]
    total = part.sum * a + w.sum(-1)
    values = keys[..., :value_dim]
    if final:  # (w / total) @ v + acc * (a / total): the rows written once, in q's dtype, rounded once
        total = torch.where(total > 0, total, 1.0)[..., None]  # (0: a row that saw nothing, as `normalize`)
        drafts = torch.bmm(w / total, values.to(w.dtype))
        out = torch.empty_like(part.acc, dtype=q.dtype)
        return Final(torch.addcmul(drafts, part.acc, a[..., None] / total, out=out))
    acc = (part.acc * a[..., None]).baddbmm_(w, values.to(w.dtype))  # (in place: no copy of the rows)
    return Partial(acc, top, total)
