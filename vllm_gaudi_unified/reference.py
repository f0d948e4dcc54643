"""The dense reference: an obviously correct loop, trusted first, used by every check.

Per request, build the full key/value sequence (cache positions through the
block table, then the new tokens) and apply softmax over what each token may
see. float64 throughout.
"""
from __future__ import annotations

import torch


def reference_attention(query, key, value, key_cache, value_cache, query_lens, context_lens, block_table,
                        scale: float, *, sliding_window: int | None = None, logits_soft_cap: float | None = None,
                        sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as `unified_attention`, computed in float64 one request at a time."""
    bs = key_cache.shape[1]
    hq, hkv = query.shape[1], key.shape[1]
    group = hq // hkv
    out = torch.zeros(query.shape, dtype=torch.float64)
    start = 0
    for r, (q_len, ctx) in enumerate(zip(map(int, query_lens), map(int, context_lens))):
        blocks = [int(b) for b in block_table[r][: -(-ctx // bs)]]
        cached_k = torch.cat([key_cache[b] for b in blocks])[:ctx] if ctx else key_cache[:0, 0]
        cached_v = torch.cat([value_cache[b] for b in blocks])[:ctx] if ctx else value_cache[:0, 0]
        keys = torch.cat([cached_k.cpu(), key[start:start + q_len].cpu()]).double()  # [ctx + q_len, Hkv, D]
        values = torch.cat([cached_v.cpu(), value[start:start + q_len].cpu()]).double()
        for j in range(q_len):
            p = ctx + j
            lo = 0 if sliding_window is None else max(0, p - sliding_window + 1)
            for h in range(hq):
                s = keys[lo:p + 1, h // group] @ query[start + j, h].cpu().double() * scale
                if logits_soft_cap is not None:
                    s = logits_soft_cap * torch.tanh(s / logits_soft_cap)
                if sinks is not None:
                    s = torch.cat([s, sinks[h:h + 1].cpu().double()])
                w = torch.softmax(s, 0)[: p + 1 - lo]
                out[start + j, h] = w @ values[lo:p + 1, h // group]
        start += q_len
    return out
