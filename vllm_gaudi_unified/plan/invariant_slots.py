"""The batch-invariant mode's fast-route arrays (CUDA flash + Triton; `plan/invariant.py` says what and why):
each token's (token, block) slots for the Triton kernel, with where they start and how many a token has at
most, and the flash segments of the requests whose context is one segment. Host numpy, vectorised."""
from __future__ import annotations

import numpy as np

from vllm_gaudi_unified.plan.arrays import ranges


def most(n: np.ndarray) -> int:
    """The largest entry of `n` (0 when it is empty)."""
    return int(n.max()) if n.size else 0


def plan_slots(pair_req, pair_blk, phys, tokens, starts, ctx, tok_pos, bs, W):
    """(token, block) slots of the Triton route, by token, then position: of request r's first `tokens[r]`
    tokens (its new tokens; 1 for a unit, whose first token's slots serve all of them; 0: not this route);
    `starts` `[tokens + 1]`: token t's slots are entries `starts[t]:starts[t + 1]`; `most`: the most of a token."""
    keep = tokens[pair_req] > 0
    pair_req, pair_blk, phys = pair_req[keep], pair_blk[keep], phys[keep]
    row_j, row_pair = ranges(np.zeros_like(pair_req), tokens[pair_req])
    req, blk, ids = pair_req[row_pair], pair_blk[row_pair], phys[row_pair]
    tok = starts[req] + row_j
    hi = np.minimum(bs, ctx[req] - blk * bs)
    lo = np.zeros_like(hi) if W is None else np.clip(tok_pos[tok] - W + 1 - blk * bs, 0, hi)
    sel = lo < hi
    order = np.lexsort((blk[sel], tok[sel]))
    tok, ids, lo, hi = tok[sel][order], ids[sel][order], lo[sel][order], hi[sel][order]
    per_token = np.bincount(tok, minlength=tok_pos.size)
    return dict(rows=tok.astype(np.int32), blocks=ids, lo=lo.astype(np.int32), hi=hi.astype(np.int32),
                starts=np.concatenate([[0], np.cumsum(per_token)]).astype(np.int32), most=most(per_token))


def plan_ctx_segments(reqs, q, starts, ctx, nb_ctx, bt, bs):
    """The context of each request in `reqs` as one flash segment: its tokens against its blocks."""
    rows, _ = ranges(starts[reqs], q[reqs])
    flat, owner = ranges(np.zeros_like(reqs), nb_ctx[reqs])
    blocks = bt[reqs[owner], flat] if flat.size else np.zeros(0, np.int64)
    cu = lambda n: np.concatenate([[0], np.cumsum(n)]).astype(np.int32)  # noqa: E731
    return dict(rows=rows.astype(np.int32), cu_q=cu(q[reqs]), blocks=blocks, cu_k=cu(nb_ctx[reqs] * bs),
                used=ctx[reqs].astype(np.int32), max=(max(2, most(q[reqs])), most(nb_ctx[reqs]) * bs))
