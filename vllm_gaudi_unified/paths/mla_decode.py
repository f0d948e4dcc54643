"""MLA's unique pairs without a partial per block: one Partial row per token, the latent read once.

The unique path's matmul tiles write one fp32 partial per (block, head):
`[blocks, 128, 512]` at DeepSeek's shapes, twice the latent cache they read
(docs/benchmarks.md, MLA). A latent step (`mla.latent_views`: one KV head,
values the first dims of the keys, views of one cache) takes one of three
routes instead, chosen by `mla_unique_route`:

* 'kernel' (CUDA, Triton, 16-bit): `mla_kernel.py`, the token's slots in one
  program per head group and split, the values taken from the key tile, the
  token's own pair inside (split 0 starts from it); on sm_90 a Gluon kernel
  (`gluon_applies`: the same contract, TMA): FlashMLA's seesaw (`mla_gluon_seesaw.py`)
  where its shapes allow, else `mla_gluon.py`.
* 'chunks' (torch ops only: an HPU, the Gaudi route): `mla_chunks.py`, each
  token's blocks in chunks whose table is built on the device in the bucket's
  shapes, so a graph captured once per bucket replays it for every step.
* 'dense' (torch ops only, the CPU): the token's visible
  slots laid out as one padded `[tokens, keys]` table on the host
  (`decodes.decode_layout`, the CPU decode route's layout), gathered once as
  `[tokens, keys, L + R]`, then two batched matmuls over all query heads
  (`[tokens, H, L + R] @ latent^T`, `p @ latent[..., :L]`: the values are a
  view of the gathered keys; `mla_shared.latent_attend`, which the shared
  tiles of a latent step run too). A step of decodes only (one token per
  request); its shapes follow the step (the width is rounded up to whole
  blocks, eight widths per power of two, so a server sees few), so it runs
  only on the CPU and not while torch compiles: nothing may capture it.

All return the Partial the merge takes, so the shared prefix stays on the
shared path (read once per tile of tokens) and the merge is unchanged. All
take each token's own pair as well (the 'dense' route writes the token's
latent into its row's first padding column), so a decode step has no self
pair to compute and merge: `attention._run_paths` skips it for them.
"""
from __future__ import annotations

import math
import weakref

import torch
import torch.nn.functional as F

from vllm_gaudi_unified.flags import env_flag
from vllm_gaudi_unified.merge import Final, Partial
from vllm_gaudi_unified.paths import fused
from vllm_gaudi_unified.paths.causal import self_partial
from vllm_gaudi_unified.paths.decodes import decode_layout
from vllm_gaudi_unified.paths.kv_quant import one_tensor_scale, read_blocks
from vllm_gaudi_unified.paths.mla_drafts import fold_drafts
from vllm_gaudi_unified.paths.mla_shared import latent_attend, latent_cache
from vllm_gaudi_unified.paths.tiles import compute_dtype, product_dtype
from vllm_gaudi_unified.paths.unique import KERNEL_CACHE_DTYPES, _pow2, _slots_with_shared, per_token, token_order
from vllm_gaudi_unified.paths.unique import combine_splits, triton_importable

#: Kernel constants: query heads per program, keys per loop step, keys a split aims at (power-of-two
#: splits, at most `MLA_MAX_SPLITS`), warps, stages, how the tile is loaded (`mla_kernel.py`). Chosen on an
#: H100 by a sweep of these constants at 128 heads: 64 heads x
#: 64 keys on 8 warps is the one shape whose products run on Hopper's `wgmma` without spilling (253-255
#: registers, 216 KB of shared memory: one program per SM). `MLA_WARPS` needs 64 heads per program (two
#: warpgroups); a program of fewer heads (a tensor-parallel shard) runs 4 warps.
MLA_BLOCK_H = 64
MLA_KEYS = 64
MLA_SPLIT_KEYS = 16384
MLA_MAX_SPLITS = 32
#: Whether a step of few tokens splits their keys further, so that its programs (head groups x tokens x splits)
#: fill the GPU's SMs once (flash decoding: 4 decodes x 32k keys are 8 programs of 64 heads on 132 SMs), each
#: split keeping at least `MLA_SPLIT_MIN_KEYS` keys (its query staged and its rows merged once). Measured on an
#: H100 (docs/benchmarks.md, MLA; the splits merged by `mla_kernel.split_combine`): 4 decodes x
#: 32k keys 0.246 -> 0.087 ms of GPU time per step, 16 x 8k 0.242 -> 0.089; 128 x 4096 unchanged (1 split).
MLA_FILL_SMS = True
MLA_SPLIT_MIN_KEYS = 1024
MLA_WARPS = 8
MLA_STAGES = 2
MLA_V_LOAD = 0
#: Whether a key tile that lies in one slot (`MLA_KEYS` divides the block size) reads its slot's block and
#: bounds once as scalars (`mla_kernel.py`: ONE_SLOT), not once per key (H100: 1.42 -> 0.91 ms of kernel
#: at 32 heads a program, spills 30 -> 2).
MLA_ONE_SLOT = True
#: Whether the kernel loads its query tile in every loop step (`mla_kernel.py`: Q_LOOP), not once before
#: the loop (H100: the same kernel time, 0.68 ms, the step 0.98 -> 0.89 ms; Triton hoists the load out of
#: the loop either way, as its SASS shows).
MLA_Q_LOOP = True
#: Measured on an H100 against these constants: the cache's row stride made a compile-time
#: constant took the kernel from 0.67 to 0.62 ms; every other variant swept (the latent in halves, tensor
#: descriptors, loop pipelining, warp specialisation, the products transposed for 16 or 32 heads per program,
#: unmasked whole slots first, sums per key, 32-key tiles, two splits) ran 0.62-2.1 ms.

#: The kernel takes a step's shared tiles too, as more slots of each tile row's token (`kernel_mla_partial(shared=
#: True)`): one kernel, no shared partials to write and merge. Grouping a tile's tokens into one product
#: (`mla_shared.py`) reads the prefix once per tile; here each token's program reads it, but the tokens of a
#: group read it at about the same time, so HBM serves it once and L2 the rest. Measured on an H100
#: (64 decodes x (4096 shared + 256)): 0.37 against 1.34 ms of GPU
#: time at 128 heads, 0.54 against 3.20 ms wall-clock at a tensor-parallel shard's 16; the prefix read once
#: (33 MB from HBM against 330 MB unshared). False: the shared route beside the kernel (benchmarks, tests).
MLA_KERNEL_SHARED = True
#: The Gluon kernel (`mla_gluon.py`: key tiles by TMA, both warpgroups on disjoint halves of the scores and of
#: the values) where it applies (`gluon_applies`: sm_90, 16-bit, 64-head groups,
#: the values 512 dims or fewer, whole key tiles per block). `VLLM_GAUDI_UNIFIED_MLA_GLUON=1` on, `=0` off, unset:
#: `MLA_GLUON_DEFAULT`; read once at import. Its keys per tile, ring stages, when the next tile's scores are
#: issued and whether the softmax sums are kept per key (`mla_gluon.py`: PIPE, LAZY_SUM).
MLA_GLUON_DEFAULT = True
_GLUON_ENV = env_flag("VLLM_GAUDI_UNIFIED_MLA_GLUON")
MLA_GLUON: bool = MLA_GLUON_DEFAULT if _GLUON_ENV is None else _GLUON_ENV
MLA_GLUON_KEYS = 64
MLA_GLUON_STAGES = 2
MLA_GLUON_PIPE = 2
MLA_GLUON_LAZY_SUM = True
MLA_GLUON_META_AHEAD = True
#: FlashMLA's "seesaw" schedule (`mla_gluon_seesaw.py`: tiles in pairs, one warpgroup's softmax under the other's
#: products) where its shapes allow (64-key tiles, rope 64, values 128-512), and its worker warpgroup's registers.
#: Measured on an H100 (kernel time, one process): 128 x 4096 0.289 ms
#: (1.43x the HBM floor) against 0.350 for `mla_gluon.py`'s one-stream kernel and 0.357 for a ping-pong that
#: overlapped the softmax but waited on every fetch (removed); the shared step 64 x (4096 shared + 256) 0.153
#: against 0.187 and 0.179. Off: `mla_gluon.py`'s kernel for every shape.
MLA_GLUON_SEESAW = True
MLA_GLUON_SEESAW_REGS = 256
#: Whether the Gluon kernel also takes a step's shared cells (`MLA_KERNEL_SHARED`: the same contract, more slots
#: per token). Measured on an H100 (64 decodes x (4096 shared + 256), 128
#: heads): kernel 0.189 against the Triton kernel's 0.326 ms, GPU time per step 0.228 against 0.365 ms, the same
#: error (0.002); its CUDA test cases (tests/mla_gluon_cases.py, shared prefixes, NaN in unread slots) pass.
#: False: such a step keeps the Triton kernel.
MLA_GLUON_SHARED = True
#: Whether a launch finds the cache's two TMA descriptors built by an earlier launch (`mla_gluon.cache_descriptors`:
#: looked up by the cache's device, address, shape, strides and dtype; none kept while a CUDA graph captures).
#: Measured on an H100: building them costs the host 33-34 us a launch, finding them 3 us; `kernel_mla_partial` 208 -> 153 us.
MLA_GLUON_DESC_CACHE = True
#: Whether a verify step's drafts run inside the kernel (`UNITS`), its rows final out of it. False: a decode's rows,
#: then `mla_drafts.fold_drafts` (fp32 rows written and read again: H200, 128 x (2 over 4k) 0.797 against 0.589 ms).
MLA_KERNEL_DRAFTS = True
_GLUON: list = []  # [module or None]: `mla_gluon` once imported (None: Gluon not importable)

_LAYOUTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # batch -> (device, its dense layout)
_ORDERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # batch -> (device, kernel's slot order)


def mla_unique_route(batch, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, cap,
                     k_scale, v_scale) -> str | None:
    """'kernel', 'dense', 'chunks' or None (the generic unique paths), all conditions in one place:

    1. A latent cache (`latent_cache`), no soft cap, at most one per-tensor scale (an fp8 cache:
       `kv_quant.one_tensor_scale`, read by 'chunks' and 'dense'): else None.
    2. CUDA with its kernels on (not the Gaudi route), Triton importable, a 16-bit cache, the
       plan's fused kernels allowed: 'kernel'.
    3. Off the CPU (an HPU, the Gaudi route's stand-in on CUDA, any other device): 'chunks'
       (`mla_chunks.py`): every shape and index from the bucket, built on the device without a host
       sync, so an HPU graph captured at warmup (or torch.compile, a CUDA graph) replays it correctly
       for every later step of its bucket.
    4. On the CPU, a step of decodes only (no split pieces), not under torch.compile, whose padded table
       is within the bounds of `decodes.decode_layout`: 'dense' (measured faster there than 'chunks').
       Its shapes and index tensors follow the step, not the bucket, so it runs only where nothing
       captures it: a graph captured at warmup would replay the warmup step's table. Else None.
    """
    if cap is not None or not one_tensor_scale(k_scale, v_scale) or not latent_cache(key_cache, value_cache):
        return None
    if (query.device.type == "cuda" and fused.CUDA_KERNELS and triton_importable()
            and key_cache.dtype in KERNEL_CACHE_DTYPES and batch.plan.options.fused_kernels):
        return "kernel"
    if query.device.type != "cpu":
        return "chunks"
    if batch.num_tokens != batch.num_requests or batch.pieces or torch.compiler.is_compiling():
        return None
    return "dense" if decode_layout(batch) is not None else None


def mla_kernel_takes_shared(batch) -> bool:
    """Does `kernel_mla_partial` take the step's shared tiles too (`MLA_KERNEL_SHARED`)? A static fact of
    the bucket, so a bucket's graph is fixed."""
    return MLA_KERNEL_SHARED and batch.shared_rows.shape[0] > 0


def kernel_mla_partial(q: torch.Tensor, key_cache: torch.Tensor, value_dim: int, batch, scale: float,
                       key: torch.Tensor | None = None, shared: bool = False,
                       final: bool = False, drafts: bool = False) -> Partial | Final | None:
    """The unique pairs through `mla_kernel.py`: one Partial row per token (splits merged by
    `split_combine`); with `key` (the new tokens' latents `[n, 1, L + R]`) each token's own pair too, so
    the step has no separate self pair to compute and merge (`attention._run_paths`); with `shared` the
    shared tiles' (row, block) cells as more slots of their rows (`mla_kernel_takes_shared`); with `final`
    (this is the step's only path) and one split, the rows normalized by the kernel in q's dtype (`Final`:
    no fp32 partial written and read again); with `drafts` (a verify step: `batch` in units) the tokens' causal
    pairs too. Slots sorted by token on the device (no sync), once per batch (a server's layers share it); the
    split count from the bucket (host numbers). On CPU it runs only under Triton's interpreter (tests)."""
    from vllm_gaudi_unified.paths import mla_kernel

    units, seg, rows = 1, None, False
    if drafts:  # each token reads its unit's slots (a slot per token with shared cells); its drafts inside
        units, seg, unit_batch, rows = batch.plan.unique_units, batch.token_seg_start, batch, not shared
        batch = batch if rows and MLA_KERNEL_DRAFTS else per_token(batch, q.shape[0])
        if not MLA_KERNEL_DRAFTS:
            part = kernel_mla_partial(q, key_cache, value_dim, batch, scale, key, shared)
            return fold_drafts(part, q, key, unit_batch, scale, value_dim, units, final)
    slots = batch.unique_rows.shape[0] + (batch.shared_lo.numel() if shared else 0)
    if slots == 0:
        part = None if key is None else self_partial(q, key, key[..., :value_dim], scale, None)
        return part if units == 1 else fold_drafts(part, q, key, unit_batch, scale, value_dim, units, final)
    n, hq, d = q.shape
    bs = key_cache.shape[1]
    order, starts, (ids, lo, hi) = _slot_order(batch, n, q.device, shared=shared)
    keys_per_token = slots * bs / max(1, batch.bucket.num_logits)
    splits = mla_splits(keys_per_token, n * -(-hq // MLA_BLOCK_H), q.device)
    dt = compute_dtype(q.dtype)
    fused_final = final and splits == 1  # (one split: the kernel writes the rows itself; more: `split_combine`)
    acc = (torch.empty((n, hq, value_dim), dtype=q.dtype, device=q.device) if fused_final  # (`FINAL`: q's dtype)
           else torch.empty((n, splits, hq, value_dim), dtype=dt, device=q.device))
    m = torch.empty((n, splits, hq), dtype=dt, device=q.device)
    total = torch.empty_like(m)
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = q if key is None else key[:, 0] if key.stride(-1) == 1 else key[:, 0].contiguous()  # (q: unused)
    consts = kernel_constants(hq, d, value_dim, bs)
    slice_ = batch.unique_blocks is None and not shared  # (a slot is its block id: `ids` unread)
    if (MLA_GLUON_SHARED or not shared) and gluon_applies(q, key_cache, value_dim, units):
        _launch_gluon(q, k, key_cache, order, starts, ids, lo, hi, slice_, acc, m, total, scale, splits, value_dim,
                      key is not None, final=fused_final, seg=seg, units=units, unit_rows=rows)
    else:
        mla_kernel.mla_kernel[(-(-hq // consts["BLOCK_H"]), splits, n)](
            q, k, key_cache, order, starts, ids, lo, hi, acc, m, total, scale, splits, q.stride(0), q.stride(1),
            k.stride(0), key_cache.stride(0), key_cache.stride(1), SLICE=slice_, SELF=key is not None,
            FINAL=fused_final, tok_ptr=None, TOKENS=False, SPLIT_KEYS=0, seg_ptr=seg, UNITS=units, UNIT_ROWS=rows, **consts)
    if fused_final:
        return Final(acc)
    if splits == 1:
        return Partial(acc[:, 0], m[:, 0], total[:, 0])
    return combine_splits(acc, m, total, q.dtype if final else None)


def kernel_constants(hq: int, d: int, value_dim: int, bs: int) -> dict:
    """`mla_kernel.mla_kernel`'s compile-time constants, warps and stages for a model's heads, latent and rope
    dims and block size (never the batch's: the batch-invariant route, `mla_invariant.py`, launches it too)."""
    block_h = min(MLA_BLOCK_H, max(16, _pow2(hq)))
    dr = d - value_dim
    return dict(HQ=hq, BLOCK_H=block_h, DV=value_dim, DV_PAD=max(16, _pow2(value_dim)), DR=dr,
                DR_PAD=max(16, _pow2(dr)), BS=bs, KEYS=MLA_KEYS, V_LOAD=MLA_V_LOAD,
                ONE_SLOT=MLA_ONE_SLOT and bs % MLA_KEYS == 0, Q_LOOP=MLA_Q_LOOP,
                num_warps=MLA_WARPS if block_h >= 64 else min(MLA_WARPS, 4),  # (8 warps: two warpgroups of 64 rows)
                num_stages=MLA_STAGES)


def mla_splits(keys_per_token: float, programs: int, device) -> int:
    """Splits of each token's keys: by the keys a split aims at (`MLA_SPLIT_KEYS`), more where the step's
    `programs` (head groups x tokens) leave SMs idle (`MLA_FILL_SMS`: the most that still fit the SMs once, so
    no split adds a wave, each at least `MLA_SPLIT_MIN_KEYS` keys); a power of two, at most `MLA_MAX_SPLITS`. Host
    numbers from the bucket and the device, so a bucket's graph has one split count."""
    splits = _pow2(max(1, math.ceil(keys_per_token / MLA_SPLIT_KEYS)))
    sms = _sm_count(device) if MLA_FILL_SMS else 0
    fill = min(sms // max(1, programs), int(keys_per_token // MLA_SPLIT_MIN_KEYS))
    if fill > 1:  # (the largest power of two not above it)
        splits = max(splits, 1 << (fill.bit_length() - 1))
    return min(MLA_MAX_SPLITS, splits)


_SMS: dict = {}  # CUDA device index -> its SM count


def _sm_count(device) -> int:
    """The device's SM count (0 off CUDA: the interpreter's splits follow the keys alone)."""
    if device.type != "cuda":
        return 0
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SMS:
        _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SMS[index]


def _gluon():
    """`mla_gluon` imported once, or None where Triton has no Gluon (or no Hopper module)."""
    if not _GLUON:
        try:
            from vllm_gaudi_unified.paths import mla_gluon
        except ImportError:
            mla_gluon = None
        _GLUON.append(mla_gluon)
    return _GLUON[0]


def gluon_applies(q: torch.Tensor, key_cache: torch.Tensor, value_dim: int, units: int = 1) -> bool:
    """Whether `kernel_mla_partial` takes the Gluon kernel: switched on (`MLA_GLUON`), an sm_90 GPU, a 16-bit
    cache and query of one dtype, query heads in groups of 64, the values 64-512 dims and the rope part
    16-256 (powers of two) (the TMA boxes and `wgmma` shapes), whole tiles per block, cache rows
    contiguous blocks 16-byte aligned (the TMA descriptors), Gluon importable, not while torch compiles; drafts
    (`units` > 1) on the seesaw kernel only, 3 at most (its statistics in shared memory: 1 + 3 passes sm_90's)."""
    if not (MLA_GLUON and q.device.type == "cuda" and key_cache.dtype in KERNEL_CACHE_DTYPES
            and q.dtype == key_cache.dtype) or torch.compiler.is_compiling():
        return False  # (under torch.compile the Triton kernel, which dynamo traces; Gluon's TMA launch is untested)
    n, hq, d = q.shape
    bs, dr = key_cache.shape[1], d - value_dim
    keys = MLA_GLUON_KEYS
    if (hq % 64 or value_dim not in (64, 128, 256, 512) or dr not in (16, 32, 64, 128, 256) or bs % keys
            or key_cache.shape[-1] != d or (units > 1 and not _seesaw(d, value_dim, units))):
        return False
    sc_s = key_cache.stride(1)
    if (key_cache.stride(-1) != 1 or sc_s % 8 or key_cache.stride(0) != bs * sc_s
            or key_cache.data_ptr() % 16 or q.stride(1) % 8 or q.stride(0) % 8):
        return False
    return torch.cuda.get_device_capability(q.device) == (9, 0) and _gluon() is not None


def _seesaw(d: int, value_dim: int, units: int = 1) -> bool:  # (`MLA_GLUON_SEESAW` on, and its shapes)
    return MLA_GLUON_SEESAW and MLA_GLUON_KEYS == 64 and d - value_dim == 64 and value_dim >= 128 and units <= 3


def _launch_gluon(q, k, key_cache, order, starts, ids, lo, hi, slice_, acc, m, total, scale, splits, value_dim,
                  with_self, final=False, seg=None, units=1, unit_rows=False):
    """`mla_gluon_seesaw.mla_gluon_seesaw_kernel` (`MLA_GLUON_SEESAW`, where its shapes allow) or
    `mla_gluon.mla_gluon_kernel` on the same arguments as the Triton kernel (the slots' `ids`, `lo`, `hi`: the
    unique slots', or with the shared cells after them), the cache as TMA descriptors."""
    g = _gluon()
    n, hq, d = q.shape
    keep = MLA_GLUON_DESC_CACHE and not torch.cuda.is_current_stream_capturing()
    seesaw = _seesaw(d, value_dim)
    kn_desc, kr_desc = g.cache_descriptors(key_cache, value_dim, MLA_GLUON_KEYS, keep, halves=seesaw)
    if seesaw:
        from vllm_gaudi_unified.paths import mla_gluon_seesaw

        mla_gluon_seesaw.mla_gluon_seesaw_kernel[(hq // 64, splits, n)](
            q, k, kn_desc, kr_desc, order, starts, ids, lo, hi, acc, m, total, scale, splits, q.stride(0), q.stride(1),
            k.stride(0), HQ=hq, DV=value_dim, DR=64, BS=key_cache.shape[1], KEYS=64, SLICE=slice_, SELF=with_self,
            REGS=MLA_GLUON_SEESAW_REGS, FINAL=final, seg_ptr=starts if seg is None else seg, UNITS=units,
            UNIT_ROWS=unit_rows, num_warps=4, tok_ptr=None, TOKENS=False, SPLIT_KEYS=0, out_ptr=None, ONE_KEYS=0)
        return
    g.mla_gluon_kernel[(hq // 64, splits, n)](
        q, k, kn_desc, kr_desc, order, starts, ids, lo, hi, acc, m, total, scale, splits,
        q.stride(0), q.stride(1), k.stride(0), HQ=hq, DV=value_dim, DR=q.shape[-1] - value_dim, BS=key_cache.shape[1],
        KEYS=MLA_GLUON_KEYS, STAGES=MLA_GLUON_STAGES, SLICE=slice_, SELF=with_self,
        PIPE=MLA_GLUON_PIPE, LAZY_SUM=MLA_GLUON_LAZY_SUM, META_AHEAD=MLA_GLUON_META_AHEAD, FINAL=final, num_warps=8)


def _slot_order(batch, n: int, device, keep: bool = True, shared: bool = False):
    """The unique slots (with `shared`: then the shared cells, `_slots_with_shared`) sorted by token, each
    token's start in that order (`n + 1` starts) and the slots' (block ids, lo, hi) (the ids unused for the
    slice layout), on `device`, once per batch eagerly with `keep` (not kept while torch compiles or a CUDA
    graph captures: a graph replays with its batch's buffers refilled, so it must sort them itself)."""
    eager = keep and not (torch.compiler.is_compiling()
                          or (device.type == "cuda" and torch.cuda.is_current_stream_capturing()))
    hit = _ORDERS.get(batch) if eager else None
    if hit is not None and hit[0] == (device, n, shared):
        return hit[1]
    if shared:
        rows, *slots = _slots_with_shared(batch, n)
    else:
        rows, slots = batch.unique_rows, [batch.unique_blocks, batch.unique_lo, batch.unique_hi]
    order, starts = token_order(rows, n)
    if slots[0] is None:
        slots[0] = order
    out = order, starts, tuple(slots)
    if eager:
        _ORDERS[batch] = ((device, n, shared), out)
    return out


def dense_mla_partial(q: torch.Tensor, key_cache: torch.Tensor, value_dim: int, batch, scale: float,
                      key: torch.Tensor | None = None, kv_scale=None) -> Partial | None:
    """The unique pairs of a decode step as one gather and two batched matmuls over all heads
    (module docstring); rows past the requests are empty (max -inf, sum 0). With `key` (the new tokens'
    latents `[n, 1, L + R]`) each token's own pair too: its latent is written into the first padding
    column of its row (`_layout` leaves one), so the step has no separate self pair to compute and merge.
    An fp8 cache is dequantized as gathered, with its one scale `kv_scale` (`kv_quant.read_blocks`)."""
    table, visible, unread, masked, self_col = _layout(batch, q.device, key is not None)
    r, width = table.shape
    if width == 0:
        return None if key is None else self_partial(q, key, key[..., :value_dim], scale, None)
    n, hq, d = q.shape
    kv = read_blocks(key_cache.view(-1, d), table, kv_scale, q.dtype)  # [R, keys, L + R]: keys, values their dims
    if unread:  # a row with no cached key read some slot it may not see: zero it (NaN * 0 is NaN)
        kv = torch.where(visible[..., None], kv, torch.zeros((), dtype=kv.dtype, device=kv.device))
    # (a masked slot of any other row repeats one of its visible slots: `_layout`)
    if key is not None:
        kv[torch.arange(r, device=kv.device), self_col] = key[:r, 0].to(kv.dtype)
    bias = None
    if masked:  # some row sees fewer keys than the width (ragged, padded): -inf there
        bias = torch.zeros((r, 1, 1, table.shape[1]), dtype=product_dtype(q.dtype), device=q.device)
        bias = bias.masked_fill_(~visible[:, None, None, :], float("-inf"))
    acc, m, total = latent_attend(q[:r], kv, bias, value_dim, scale)  # [R, H, L], [R, H]
    if n > r:
        acc = F.pad(acc, (0, 0, 0, 0, 0, n - r))
        m = F.pad(m, (0, 0, 0, n - r), value=float("-inf"))
        total = F.pad(total, (0, 0, 0, n - r))
    return Partial(acc, m, total)


def _layout(batch, device, with_self: bool = False):
    """`decode_layout`'s table and visibility without its self column, the width padded to whole blocks,
    eight widths per power of two (padding: the row's first slot again, not visible), on `device`, and
    `masked` (some slot not visible); `with_self`: at least one padding column, row r's first one
    (`self_col[r]`) visible (its token's own latent goes there). Once per batch."""
    hit = _LAYOUTS.get(batch)
    if hit is not None and hit[0] == (device, with_self):
        return hit[1]
    layout = decode_layout(batch)  # a step of decodes only (`mla_unique_route`): row r is token r
    table, visible, unread = layout.table, layout.visible[:, :-1], layout.unread_rows
    bs, width = batch.block_size, table.shape[1]
    per_row = visible.sum(1)
    blocks = math.ceil((width + (with_self and width > 0)) / bs)
    step = max(1, _pow2(blocks) // 8)  # eight widths per octave: under 1/4 padding, few shapes
    padded = bs * step * math.ceil(blocks / step)
    if padded > width:
        table = torch.cat([table, table[:, :1].expand(-1, padded - width)], 1)
        visible = F.pad(visible, (0, padded - width), value=False)
    if with_self and width > 0:
        visible[torch.arange(table.shape[0]), per_row] = True
    out = (table.to(device), visible.to(device), unread, not bool(visible.all()), per_row.to(device))
    _LAYOUTS[batch] = ((device, with_self), out)
    return out
