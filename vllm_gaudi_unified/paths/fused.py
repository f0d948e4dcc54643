"""The device's fused attention kernel, where it returns what the merge needs.

A path can only hand its rows to the exact merge if it knows each row's
log-sum-exp (or max and sum). Two fused kernels give it:

* CUDA: `torch.ops.aten._flash_attention_forward`, flash attention over
  *varlen* input (flattened rows, int32 cumulative lengths), GQA without
  repeating K/V, optional causal mask and left window, `seqused_k` (use only
  the first keys of each segment); it returns the output and the LSE
  `[Hq, rows]` in fp32. Scores never leave the chip.
* HPU: FusedSDPA's forward with statistics (`torch.ops.hpu.sdpa_recomp_fwd`,
  the call vllm-gaudi's sliced FusedSDPA merges chunks with) on the causal and
  shared tiles, `sdpa_attend` (when: `hpu.select_fused_sdpa`).

`fused_kernel` says which one runs; all conditions live there. Everything else
(soft cap, float32/float64 inputs, CPU) takes the matmul tiles of `tiles.py`,
which stay the reference and the fallback. Every caller turns the kernel's
normalised output into a `Partial` with `lse_partial`: acc = out, max = LSE,
sum = 1 (so acc / sum = out and the row's weight is e^LSE).
"""
from __future__ import annotations

import contextlib

import torch

from vllm_gaudi_unified.flags import env_flag
from vllm_gaudi_unified.merge import Partial, compute_dtype

#: The CUDA kernel; a module attribute so CPU tests can put an exact stand-in in its place.
FLASH = torch.ops.aten._flash_attention_forward
#: CUDA-only kernels (flash varlen, the unique path's Triton kernel) allowed. Off (`gaudi_route()`, or
#: `VLLM_GAUDI_UNIFIED_GAUDI_ROUTE=1`): a CUDA device runs what an HPU runs, the matmul tiles and the
#: prompt route's plain SDPA call (FusedSDPA on a Gaudi), for side-by-side measurements.
CUDA_KERNELS = not env_flag("VLLM_GAUDI_UNIFIED_GAUDI_ROUTE")
#: CUDA grid limit on the batch dimension of flash's non-varlen launch (the unique path's one block per segment).
MAX_FLASH_BATCH = 65535
#: Unique path through flash (one segment per block) from this block size up: measured on an H100
#: (`python -m benchmarks.speed`): faster than the matmul tiles at block size 128, 3x slower at 16.
FUSED_UNIQUE_MIN_BLOCK_SIZE = 64


def fused_kernel(device_type: str, dtype: torch.dtype, head_dim: int, soft_cap: float | None,
                 enabled: bool = True) -> str | None:
    """'flash', 'hpu' or None (the matmul tiles). All conditions in one place:

    1. `PlanOptions.fused_kernels` off, or a soft cap (neither kernel takes one): None.
    2. Not a 16-bit float (the float64 checks, fp32 runs): None.
    3. CUDA with a head size flash takes (a multiple of 8, at most 256), CUDA kernels on: 'flash'.
    4. HPU with habana_frameworks importable: 'hpu' (`hpu.select_fused_sdpa`).
    5. Otherwise None.
    """
    if not enabled or soft_cap is not None or dtype not in (torch.float16, torch.bfloat16):
        return None
    if device_type == "cuda":
        return "flash" if CUDA_KERNELS and head_dim % 8 == 0 and head_dim <= 256 else None
    if device_type == "hpu":
        from vllm_gaudi_unified.hpu import select_fused_sdpa

        return "hpu" if select_fused_sdpa(device_type, dtype) else None
    return None


@contextlib.contextmanager
def gaudi_route():
    """Within: the Gaudi route on CUDA (`CUDA_KERNELS` off). Graphs and compiled functions keep the
    route they were made under (`graphs.bucket_key` includes it)."""
    global CUDA_KERNELS
    saved, CUDA_KERNELS = CUDA_KERNELS, False
    try:
        yield
    finally:
        CUDA_KERNELS = saved


def kernel_for(batch, query: torch.Tensor, soft_cap: float | None, value_dim: int | None = None) -> str | None:
    """`fused_kernel` for this batch's options and these inputs; None when the values' head dim
    (`value_dim`) differs from the keys' (MLA's latent: flash and FusedSDPA take one head dim)."""
    if value_dim is not None and value_dim != query.shape[-1]:
        return None
    return fused_kernel(query.device.type, query.dtype, query.shape[-1], soft_cap, batch.plan.options.fused_kernels)


def lse_partial(out: torch.Tensor, lse: torch.Tensor) -> Partial:
    """A fused kernel's normalised rows `[rows, Hq, D]` and LSE `[rows, Hq]` as a `Partial` (sum 1)."""
    lse = lse.to(compute_dtype(out.dtype))
    return Partial(out.to(lse.dtype), lse, torch.ones_like(lse))


def clean_causal_values(v: torch.Tensor, seg_start: torch.Tensor,
                        window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """v `[T, Hkv, D]` with non-finite entries set to 0, and `[T, Hkv]`: the rows (tokens) whose causal
    keys include a non-finite value, i.e. token j of the same request with j <= i (and i - j < window).

    Flash multiplies masked keys' zero weights by V inside a tile, so a NaN in V of token j would reach
    earlier rows and rows outside the window; with V zeroed they stay finite, and the rows that may see
    it are marked afterwards (`mark_bad_rows`). A segmented count: a cumulative sum of bad tokens minus
    its value before each row's first visible key. K needs nothing: flash masks scores by select.

    The sum runs over one flat vector, heads-major (each head's tokens in a row; a difference within a
    head is that head's count): a 1-D scan is one parallel (CUB) pass on CUDA, where a scan over dim 0
    of `[T, Hkv]` is one thread per head walking all T tokens in turn (0.18 us a token on the H200:
    most of an invariant 4 x 2k prompt step)."""
    t, h = v.shape[:2]
    finite = torch.isfinite(v)
    bad = (~finite.all(-1)).to(torch.int32)  # [T, Hkv]
    total = torch.cat([bad.new_zeros(1), torch.cumsum(bad.t().reshape(-1), 0)])  # [1 + Hkv * T]
    i = torch.arange(t, device=v.device)
    lo = seg_start[:t].to(i.dtype)
    if window is not None:
        lo = torch.maximum(lo, i - (window - 1))
    head = (torch.arange(h, device=v.device) * t)[None, :]  # [1, Hkv]: each head's first entry
    seen = total[head + (i + 1)[:, None]] - total[head + lo[:, None]]  # [T, Hkv]
    return torch.where(finite, v, torch.zeros((), dtype=v.dtype, device=v.device)), seen > 0


def poison_keys(k: torch.Tensor, v: torch.Tensor, ok: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """k, v `[T, Hkv, D]` for causal calls that hide later keys' scores by selection (`prompts.causal_selects`):
    a token's head whose key or value has a non-finite entry goes in with a NaN key and a zero value, so
    exactly the rows that see it come out NaN (their score, their LSE), and no other row's sum changes (a
    hidden score is selected away, its zero value adds an exact 0). No scan and no pass over the rows
    afterwards. `ok`: `finite_heads(k, v)` of these rows, when already taken for a larger tensor."""
    ok = (finite_heads(k, v) if ok is None else ok)[..., None]
    nan, zero = (torch.full((), x, dtype=k.dtype, device=k.device) for x in (float("nan"), 0.0))
    return torch.where(ok, k, nan), torch.where(ok, v, zero)


def finite_rows(x: torch.Tensor) -> torch.Tensor:
    """`isfinite(x).all(-1)` as one max-magnitude reduction (NaN and inf propagate through it) where
    `isfinite` and `all` are several kernels and a bool copy of `x`. (Not `(x * 0).sum() == 0`:
    torch.compile folds `x * 0` to 0 and lets every bad entry through.) An HPU takes the plain form."""
    if x.device.type == "hpu":
        return torch.isfinite(x).all(-1)
    return torch.linalg.vector_norm(x, float("inf"), -1).isfinite()


def finite_heads(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """`[T, Hkv]` whether a token's key and value of a head are finite (`v is k`: a latent cache)."""
    finite = finite_rows(k)
    return finite if v is k else finite & finite_rows(v)


def mark_bad_rows(part: Partial, bad: torch.Tensor) -> Partial:
    """Rows `[rows, Hkv]` that saw a bad value get NaN max, sum and acc, for every query head of the KV
    head, as a NaN score gives on the tile paths (`tiles.mask_scores`): the merge and `normalize` keep
    the NaN for those rows alone, even when this is the only partial."""
    g = part.max.shape[1] // bad.shape[1]
    bad = bad.repeat_interleave(g, 1)
    nan = lambda x, b: torch.where(b, float("nan"), x)  # noqa: E731
    return Partial(nan(part.acc, bad[..., None]), nan(part.max, bad), nan(part.sum, bad))


def flash_varlen(q, k, v, cu_q, cu_k, max_q: int, max_k: int, scale: float, *, causal: bool,
                 window: int | None = None, seqused_k: torch.Tensor | None = None) -> Partial:
    """Flash attention over segments: rows `cu_q[i]:cu_q[i+1]` see keys `cu_k[i]:cu_k[i+1]` (their first
    `seqused_k[i]` when given); causal is bottom-right aligned; `window` keeps the last `window` positions.
    Rows past `cu_q[-1]` are left unwritten (their partial is garbage: callers drop them)."""
    out, lse = FLASH(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False, scale=scale,
                     window_size_left=None if window is None else window - 1,
                     window_size_right=None if window is None else 0, seqused_k=seqused_k)[:2]
    return lse_partial(out, lse.t())


def flash_blocks(q, k, v, scale: float) -> Partial:
    """One query row per segment of whole blocks: q `[S, Hq, D]`, k/v `[S, keys, Hkv, D]` -> Partial `[S, Hq, D]`
    (flash's batched launch; with one query row it packs a KV head's query heads into one tile)."""
    out, lse = FLASH(q[:, None], k, v, None, None, 1, k.shape[1], 0.0, False, False, scale=scale)[:2]
    return lse_partial(out[:, 0], lse[:, :, 0])


def sdpa_attend(q, k, v, mask, scale, soft_cap=None, masked_tiles=None):  # pragma: no cover - needs a Gaudi
    """`tiles.attend` through Gaudi's FusedSDPA with statistics: q `[T, R, Hq, D]`, k/v `[T, K, Hkv, D]`,
    mask `[T, R, K]` -> Partial `[T*R, Hq, D]`. Untested on a Gaudi (none here); `sdpa_stats_partial`
    is tested on CPU against a stand-in with the op's outputs (tests/test_fused.py)."""
    import habana_frameworks.torch  # noqa: F401  (registers torch.ops.hpu)

    return sdpa_stats_partial(torch.ops.hpu.sdpa_recomp_fwd, q, k, v, mask, scale)


def sdpa_stats_partial(op, q, k, v, mask, scale) -> Partial:
    """The device-independent part of `sdpa_attend`, with the kernel `op` passed in.

    K/V are expanded to the query heads (a view; no GQA reshape to get wrong), masked keys get a
    -inf bias, rows that see no key are set to the empty partial (-inf, 0, 0) whatever the kernel
    returns for them. Non-finite K/V entries are zeroed before the call (a bad value times a zero
    weight, or NaN plus a -inf bias, is still NaN: it would reach rows that never see the key) and
    the rows that see such a key are marked NaN afterwards (`mark_bad_rows`)."""
    t, r, hq, d = q.shape
    hkv = k.shape[2]
    dt = compute_dtype(q.dtype)
    zero = torch.zeros((), dtype=v.dtype, device=v.device)
    key_bad = ~finite_heads(k, v)  # [T, K, Hkv]
    row_bad = (mask[:, :, :, None] & key_bad[:, None]).any(2).reshape(t * r, hkv)
    k = torch.where(torch.isfinite(k), k, zero)
    v = torch.where(mask.any(1)[:, :, None, None] & torch.isfinite(v), v, zero)
    bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, float("-inf"))[:, None]
    out, m, linv = recomp_stats(op, q.permute(0, 2, 1, 3), k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3), bias, scale)
    rows = lambda x: x.permute(0, 2, 1, *range(3, x.dim())).reshape(t * r, hq, *x.shape[3:]).to(dt)  # noqa: E731
    out, m, linv = rows(out), rows(m), rows(linv)
    any_key = mask.any(-1).reshape(t * r, 1)
    total = torch.where(any_key, 1.0 / linv, 0.0)
    return mark_bad_rows(Partial(torch.where(any_key[..., None], out * total[..., None], 0.0),
                                 torch.where(any_key, m, float("-inf")), total), row_bad)


def recomp_stats(op, q, k, v, bias, scale, causal: bool = False):
    """FusedSDPA's forward with statistics (`op`: `torch.ops.hpu.sdpa_recomp_fwd` or a stand-in) on
    heads-major q `[B, Hq, S, D]`, k/v `[B, Hkv, K, D]`, additive `bias` broadcastable to `[B, 1, S, K]`
    or None, `causal` top-left (row i sees keys 0..i): the normalised rows `[B, Hq, S, D]`, the row max
    and the inverse row sum `[B, Hq, S]`, as vllm-gaudi's `SlicedFusedSDPA` merges its chunks with.
    K/V are expanded to the query heads (a view; no GQA reshape to get wrong)."""
    b, hq, s, d = q.shape
    hkv = k.shape[1]
    heads = lambda x: x[:, :, None].expand(b, hkv, hq // hkv, *x.shape[2:]).reshape(b, hq, *x.shape[2:])  # noqa: E731
    out, m, linv = op(q, heads(k), heads(v), bias, 0.0, scale, causal, True, "fast", None, "right")[:3]
    return out, m.reshape(b, hq, s), linv.reshape(b, hq, s)


#: The CUDA stand-in for `sdpa_recomp_fwd` on the Gaudi route: cuDNN's SDPA with its LSE (a bias and GQA
#: natively, as FusedSDPA takes them); a module attribute so a test can count the calls.
CUDNN = torch.ops.aten._scaled_dot_product_cudnn_attention


def sdpa_lse(q, k, v, bias, scale: float, causal: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """One fused SDPA call that returns the statistics the exact merge needs: q `[B, Hq, S, D]`, k/v
    `[B, Hkv, K, D]` (GQA), additive `bias` in q's dtype broadcastable to `[B, 1, S, K]` or None,
    `causal` top-left. Returns the normalised rows `[B, Hq, S, D]` in q's dtype and the LSE `[B, Hq, S]`
    in the compute dtype. A row that sees no key is the kernel's choice (cuDNN on the H100: 0 with LSE
    -inf; the CPU's flash: 0 with LSE 0; the matmul fallback: NaN): callers select such rows away.

    Per device: a Gaudi, FusedSDPA with statistics (`recomp_stats`: LSE = m - log(linv)); CUDA, cuDNN
    (16-bit, head dim a multiple of 8 up to 128); elsewhere the CPU's flash kernel (any float dtype, GQA
    natively, returns its logsumexp)."""
    dt = compute_dtype(q.dtype)
    if q.device.type == "hpu":  # pragma: no cover - needs a Gaudi
        import habana_frameworks.torch  # noqa: F401  (registers torch.ops.hpu)

        out, m, linv = recomp_stats(torch.ops.hpu.sdpa_recomp_fwd, q, k, v, bias, scale, causal)
        return out.to(q.dtype), m.to(dt) - torch.log(linv.to(dt))
    if q.device.type == "cuda" and lse_kernel_for(q):
        if bias is not None:  # cuDNN reads a bias of the full score shape (a broadcast view is enough)
            bias = bias.expand(q.shape[0], 1, q.shape[2], k.shape[2])
        out, lse = CUDNN(q, k, v, bias, True, 0.0, causal, False, scale=scale)[:2]
        return out, lse.reshape(q.shape[:3]).to(dt)
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=bias,
                                                                             scale=scale)
        return out.to(q.dtype), lse.to(dt)
    return sdpa_lse_matmul(q, k, v, bias, scale, causal)


def lse_kernel_for(q: torch.Tensor) -> bool:
    """Whether `sdpa_lse` runs a fused kernel for queries like `q` (a Gaudi, the CPU, CUDA's cuDNN at 16
    bits and head dims it takes), not `sdpa_lse_matmul`, which holds every score of the call in memory:
    the prompt route's split form is for fused kernels only (`paths/prompts.py: prompt_final`)."""
    if q.device.type in ("hpu", "cpu"):
        return True
    return q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] % 8 == 0 \
        and q.shape[-1] <= 128


def sdpa_lse_matmul(q, k, v, bias, scale: float, causal: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """`sdpa_lse` where no kernel with statistics runs (CUDA in float32, head dims cuDNN does not take):
    the scores in the compute dtype, the query heads of a KV head as one matmul."""
    dt = compute_dtype(q.dtype)
    b, hq, s, d = q.shape
    hkv, n = k.shape[1], k.shape[2]
    scores = (q.reshape(b, hkv, hq // hkv * s, d).to(dt) @ k.to(dt).transpose(-1, -2)).view(b, hkv, -1, s, n) * scale
    if bias is not None:
        scores = scores + bias.to(dt)[:, :, None]
    if causal:
        hide = torch.arange(n, device=q.device)[None, :] > torch.arange(s, device=q.device)[:, None]
        scores = scores.masked_fill(hide, float("-inf"))
    lse = torch.logsumexp(scores, -1)
    out = torch.exp(scores - lse[..., None]).flatten(2, 3) @ v.to(dt)
    return out.reshape(b, hq, s, -1).to(q.dtype), lse.reshape(b, hq, s)
