"""Writing a step's new keys and values into the KV cache, as both plugin paths store them.

One function for the CPU platform's impl (`backend.py`) and the Gaudi impl (`hpu_backend.py`): their caches
differ only in how they are viewed, not in how a token's slot is written.
"""
from __future__ import annotations

import torch

from vllm_gaudi_unified.paths.kv_quant import is_fp8


def write_kv(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store the new tokens' K/V at their slots. key/value `[T, Hkv, D]`; caches
    `[num_blocks, block_size, Hkv, D]` (views whose block and slot axes flatten
    without a copy); slot_mapping `[T]` int64.

    Writing before attending is safe: the planner reads positions below a
    request's context_len from the cache and the new tokens from key/value, so
    no key is counted twice (the bug of the earlier Gaudi implementation).

    A slot of -1 (vLLM's `PADDING_SLOT_ID`) means "do not cache this token": a
    drafter's rows for the drafts the target rejected, positions past
    max_model_len. Such tokens write into slot 0 of block 0 instead, vLLM's
    null block, which no request's context ever reads (its content is never
    used, so colliding writes there do not matter); one fixed-shape write, no
    host sync, no data-dependent shape."""
    slots = slot_mapping.clamp(min=0)
    for new, cache in ((key, key_cache), (value, value_cache)):
        if is_fp8(cache.dtype):  # stored as bytes: index_copy_ has no fp8 kernel on the CPU
            new, cache = new.view(torch.uint8), cache.view(torch.uint8)
        # view(), not flatten(): a silent copy would drop the write; view() raises instead.
        cache.view(-1, *cache.shape[2:]).index_copy_(0, slots, new)
