"""fp8 KV caches: how a cached key or value is stored, and how a path reads it back.

A quantized cache holds `stored = x / scale` in an fp8 format (`dequantized =
stored * scale`, vLLM's convention: `layer._k_scale`). The paths dequantize
only what they gathered, right after the gather, into the query's dtype: a
tile of blocks, never the whole cache. Scales come in the forms vLLM and
vllm-gaudi store them:

- per tensor: a Python float or a one-element tensor (vLLM's `_k_scale_float`,
  vllm-gaudi's static `VLLMFP8KVCache`, whose `input_scale` is `1 / scale`);
- per block: a tensor whose first axis is the cache's block axis and whose
  other axes broadcast over a block's `[block_size, num_kv_heads, head_dim]`,
  e.g. `[num_blocks, block_size, num_kv_heads, 1]` (vllm-gaudi's dynamic
  per-token-and-head `k_scales`, `[num_slots, num_kv_heads, 1]` unflattened to
  blocks) or `[num_blocks, 1, num_kv_heads, head_dim]` (its per-channel
  `v_scales[1]`). Gathered with the same block ids as the blocks.

`quantize` is the other direction, for callers that write the cache (the vLLM
plugin's CPU path); `rounding="toward_zero"` reproduces vLLM's CPU cache-write
kernel bit for bit (it truncates), `"nearest"` is torch's cast (round to
nearest even, what the HPU cast does).
"""
from __future__ import annotations

import torch

#: fp8 formats a cache may be stored in; vLLM's `kv_cache_dtype` names them ("fp8" is e4m3).
FP8_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2,
              "fp8_inc": torch.float8_e4m3fn}
ROUNDINGS = ("nearest", "toward_zero")


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def check_scale(name: str, scale, cache: torch.Tensor) -> None:
    """A ValueError naming `name` unless `scale` is None, a positive float, a one-element tensor, or a
    per-block tensor `[num_blocks, b, h, d]` broadcasting over the cache's block `[block_size, Hkv, D]`.
    Host facts only (shapes, dtypes, Python numbers): no device sync."""
    if scale is None:
        return
    if not is_fp8(cache.dtype):
        raise ValueError(f"{name} is given but the cache dtype is {cache.dtype} (scales apply to fp8 caches: "
                         f"{sorted({str(d) for d in FP8_DTYPES.values()})})")
    if isinstance(scale, torch.Tensor):
        if not scale.dtype.is_floating_point:
            raise ValueError(f"{name} dtype must be floating point, got {scale.dtype}")
        if scale.numel() == 1:  # per tensor
            return
        if scale.dim() != 4 or scale.shape[0] != cache.shape[0] or any(
                s not in (1, c) for s, c in zip(scale.shape[1:], cache.shape[1:])):
            raise ValueError(f"{name} shape {tuple(scale.shape)} must be one element (per tensor) or "
                             f"[{cache.shape[0]}, 1|{cache.shape[1]}, 1|{cache.shape[2]}, 1|{cache.shape[3]}] "
                             "(per block: num_blocks, block_size, kv heads, head_dim)")
        if scale.device != cache.device:
            raise ValueError(f"{name} is on {scale.device} but the cache is on {cache.device}")
    elif isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0 or scale == float("inf"):
        raise ValueError(f"{name} must be None, a finite positive float or a tensor, got {scale!r}")


def one_tensor_scale(k_scale, v_scale) -> bool:
    """Whether a latent cache's scales are one per-tensor scale (or none): MLA's keys and values are the same
    stored bytes (`mla.latent_views`), so its latent routes dequantize them once, with one scale. The same
    object or equal floats, each None, a float or a one-element tensor (host facts only: no device sync)."""
    per_tensor = lambda s: s is None or not isinstance(s, torch.Tensor) or s.numel() == 1  # noqa: E731
    same = k_scale is v_scale or not isinstance(k_scale, torch.Tensor) and not isinstance(v_scale, torch.Tensor) \
        and k_scale == v_scale
    return same and per_tensor(k_scale)


def read_blocks(cache: torch.Tensor, blocks: torch.Tensor | int, scale, dtype: torch.dtype) -> torch.Tensor:
    """Cache blocks `cache[blocks]` (`blocks` an index tensor, or a count: the slice `cache[:blocks]`) in `dtype`.
    Any first axis will do with a per-tensor scale (MLA's latent routes read slots of `cache.view(-1, D)`).

    Unquantized caches are returned as gathered (a view for the slice). An fp8
    cache is converted after the gather, and multiplied by its scale (per
    tensor, or per block gathered with the same ids), so the only dequantized
    copy is the gathered one."""
    if not is_fp8(cache.dtype):
        return cache[:blocks] if isinstance(blocks, int) else cache[blocks]
    # Gathered as bytes: index kernels for fp8 dtypes are missing on some devices (index_copy_ on the CPU).
    x = cache[:blocks] if isinstance(blocks, int) else cache.view(torch.uint8)[blocks].view(cache.dtype)
    x = x.to(dtype)
    if scale is None:
        return x
    if isinstance(scale, torch.Tensor) and scale.numel() > 1:
        s = scale[:blocks] if isinstance(blocks, int) else scale[blocks]  # [*blocks.shape, b, h, d]
        return x * s.to(dtype)
    s = float(scale) if not isinstance(scale, torch.Tensor) else scale.reshape(()).to(dtype)
    return x if isinstance(s, float) and s == 1.0 else x * s


def dequantize(cache: torch.Tensor, scale, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The whole cache dequantized: for references and tests only (the paths never do this)."""
    if not is_fp8(cache.dtype):
        return cache.to(dtype)
    return read_blocks(cache, cache.shape[0], scale, dtype)


def quantize(x: torch.Tensor, fp8_dtype: torch.dtype, scale=1.0, rounding: str = "nearest",
             saturate_at: float | None = None) -> torch.Tensor:
    """`x / scale` in `fp8_dtype`; `scale` a float or a tensor broadcasting against `x`.

    `rounding="toward_zero"` truncates like vLLM's CPU cache write (its bytes,
    except that -0 is written as +0): torch's nearest cast, then one step back
    toward zero wherever that rounded away from zero (in fp8's sign-magnitude
    bits, one less in the byte is one step smaller in magnitude).

    `saturate_at`: clamp `x / scale` to +-this first, as the HPU's cast does
    (Gaudi2's e4m3 saturates at 240, Gaudi3's at 448). Without it torch's cast
    decides: e4m3 saturates at 448, e5m2 overflows to inf."""
    if not is_fp8(fp8_dtype):
        raise ValueError(f"fp8_dtype must be one of {sorted({str(d) for d in FP8_DTYPES.values()})}, got {fp8_dtype}")
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding must be one of {ROUNDINGS}, got {rounding!r}")
    y = (x.float() / scale) if not (isinstance(scale, float) and scale == 1.0) else x.float()
    if saturate_at is not None:
        y = y.clamp(-saturate_at, saturate_at)
    q = y.to(fp8_dtype)
    if rounding == "nearest":
        return q
    away = q.float().abs() > y.abs()
    return (q.view(torch.uint8) - away.to(torch.uint8)).view(fp8_dtype)


def per_token_scales(x: torch.Tensor, max_value: float) -> torch.Tensor:
    """Scales for storing `x` `[tokens, heads, head_dim]` with one scale per token and head: the
    largest magnitude maps to `max_value` (vllm-gaudi's dynamic KV quantization stores such
    `[slots, heads, 1]` scales beside its cache). An all-zero row gets the smallest normal float,
    never 0, so dequantizing never divides by or multiplies with a zero scale."""
    amax = x.abs().amax(dim=-1, keepdim=True).float()
    return (amax / max_value).clamp(min=torch.finfo(torch.float32).tiny)
