"""The dense reference: an obviously correct loop over requests, trusted first, used by every check.

Per request, build the whole key/value sequence (cache positions through the
block table, then the new tokens), a dense causal (and sliding-window) mask,
and a plain softmax. float64 throughout; GQA by repeating K/V heads.
"""
from __future__ import annotations

import torch


def reference_attention(query, key, value, key_cache, value_cache, query_lens, context_lens, block_table,
                        scale: float, *, sliding_window: int | None = None, logits_soft_cap: float | None = None,
                        sinks: torch.Tensor | None = None, causal: bool = True) -> torch.Tensor:
    """Same contract as `unified_attention`, computed in float64 one request at a time (on the CPU).

    `causal=False`: encoder-only, every token sees its whole request; a `sliding_window` W is then two-sided,
    keys less than W positions away on either side (ModernBERT's local layers, as vLLM's CPU attention and
    Hugging Face's model apply it). Values may have a head dim of their own (MLA: keys are the whole latent,
    values its first dims); the output has the values'."""
    bs = key_cache.shape[1]
    group = query.shape[1] // key.shape[1]
    out = torch.zeros((*query.shape[:2], value.shape[-1]), dtype=torch.float64)
    start = 0
    for r, (q_len, ctx) in enumerate(zip(map(int, query_lens), map(int, context_lens))):
        blocks = torch.as_tensor([int(b) for b in block_table[r][: -(-ctx // bs)]], dtype=torch.long)
        cached_k = key_cache[blocks.to(key_cache.device)].flatten(0, 1)[:ctx]  # [ctx, Hkv, D]
        cached_v = value_cache[blocks.to(value_cache.device)].flatten(0, 1)[:ctx]
        k = torch.cat([cached_k, key[start:start + q_len]]).cpu().double().repeat_interleave(group, 1)
        v = torch.cat([cached_v, value[start:start + q_len]]).cpu().double().repeat_interleave(group, 1)
        q = query[start:start + q_len].cpu().double()
        s = torch.einsum("qhd,khd->hqk", q, k) * scale  # [Hq, q_len, ctx + q_len]
        if logits_soft_cap is not None:
            s = logits_soft_cap * torch.tanh(s / logits_soft_cap)
        pos_q = ctx + torch.arange(q_len)[:, None]
        pos_k = torch.arange(ctx + q_len)[None, :]
        visible = pos_k <= pos_q if causal else torch.ones(q_len, ctx + q_len, dtype=torch.bool)
        if sliding_window is not None:
            visible &= (pos_k > pos_q - sliding_window) & (causal or pos_k < pos_q + sliding_window)
        s = s.masked_fill(~visible, float("-inf"))
        if sinks is not None:
            s = torch.cat([s, sinks.cpu().double()[:, None, None].expand(-1, q_len, 1)], dim=-1)
        p = torch.softmax(s, dim=-1)[..., : ctx + q_len]
        out[start:start + q_len] = torch.einsum("hqk,khd->qhd", p, v)
        start += q_len
    return out


def reference_mla(q_nope, q_pe, latent, latent_cache, w_uk, w_uv, query_lens, context_lens, block_table,
                  scale: float, kv_lora_rank: int, **kwargs) -> torch.Tensor:
    """Dense MLA in its expanded form, float64: per-head keys `(W_UK_h c, k_pe)` and values `c W_UV_h`
    up-projected from every latent (new tokens `[T, L + R]`, cache `[num_blocks, block_size, L + R]`),
    then `reference_attention` per head. q_nope `[T, H, P]`, q_pe `[T, H, R]`, W_UK `[H, P, L]`,
    W_UV `[H, L, V]` -> `[T, H, V]`. What `mla.py`'s latent form must equal."""
    w_uk, w_uv = w_uk.double(), w_uv.double()
    heads = w_uk.shape[0]

    def expand(lat):
        c, pe = lat[..., :kv_lora_rank].double(), lat[..., kv_lora_rank:].double()
        k_nope = torch.einsum("...l,hpl->...hp", c, w_uk)
        k = torch.cat([k_nope, pe.unsqueeze(-2).expand(*pe.shape[:-1], heads, pe.shape[-1])], dim=-1)
        return k, torch.einsum("...l,hlv->...hv", c, w_uv)

    key, value = expand(latent.cpu())
    key_cache, value_cache = expand(latent_cache.cpu())
    query = torch.cat([q_nope, q_pe], dim=-1).cpu().double()
    return reference_attention(query, key, value, key_cache, value_cache, query_lens, context_lens, block_table,
                               scale, **kwargs)
