"""`unified_attention`: check the inputs, run the paths the batch needs, merge.

`attend_step` is the same without the checks and the padding, for a server's
layers (checked once per step, inputs already bucket-sized: `BucketRows`)."""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from vllm_gaudi_unified.batch import InvariantBatch, UnifiedBatch
from vllm_gaudi_unified.merge import Final, Partial, Scattered, merge_rows, sink_partial
from vllm_gaudi_unified.paths.decodes import dense_decodes as dense_decodes_attention
from vllm_gaudi_unified.paths.decodes import dense_decodes_apply
from vllm_gaudi_unified.paths.causal import causal_partial, fused_causal_partial, self_partial
from vllm_gaudi_unified.paths.fused import kernel_for
from vllm_gaudi_unified.paths.invariant import invariant_output
from vllm_gaudi_unified.paths.mla_chunks import chunks_mla_partial
from vllm_gaudi_unified.paths.mla_decode import dense_mla_partial, kernel_mla_partial, mla_kernel_takes_shared, mla_unique_route
from vllm_gaudi_unified.paths.kv_quant import check_scale, is_fp8
from vllm_gaudi_unified.paths.prompts import final_rows, grid_rows, prompt_final, prompt_partial, write_rows
from vllm_gaudi_unified.paths.mla_shared import latent_shared_partial, mla_shared_applies
from vllm_gaudi_unified.paths.shared import fused_shared_partial, shared_partial
from vllm_gaudi_unified.paths.tiles import compute_dtype
from vllm_gaudi_unified.paths.unique import (fused_unique_applies, fused_unique_partial, kernel_takes_shared,
                                             kernel_unique_applies, kernel_unique_partial, per_token, unique_partial,
                                             units_take_new_pairs)


#: The prompt route's final form on CUDA through flash varlen (`paths/prompts.py: _flash_rows`) instead of
#: the grid's SDPA calls: None (default) when the plan says the prompts are ragged (`StepPlan.prompt_ragged`:
#: flash computes their real rows alone, the grid pads every prompt to the longest); True always, False
#: never. Measured on an H100 (`python -m benchmarks.speed`): the grid's SDPA calls (cuDNN, the calls the
#: Gaudi route makes) are faster for prompts that fill it, flash for ragged ones.
PROMPT_FLASH: bool | None = None


def prompt_flash(batch, query: torch.Tensor, value_dim: int, soft_cap: float | None) -> bool:
    """Whether the prompt route's final form is one flash varlen call (`PROMPT_FLASH`): flash takes the
    step (CUDA kernels on, 16-bit, one head dim for keys and values) and the prompts are ragged."""
    if value_dim != query.shape[-1] or kernel_for(batch, query, soft_cap) != "flash":
        return False
    return bool(getattr(batch.plan, "prompt_ragged", False)) if PROMPT_FLASH is None else PROMPT_FLASH


def unified_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                      value_cache: torch.Tensor, batch: UnifiedBatch, scale: float, *,
                      logits_soft_cap: float | None = None, sinks: torch.Tensor | None = None,
                      k_scale=None, v_scale=None) -> torch.Tensor:
    """Attention of every new token of a step; see DESIGN.md for the semantics.

    query `[T, Hq, D]`, key/value `[T, Hkv, D]` (T = the step's tokens, or the
    bucket's padded `query_len`), key_cache/value_cache `[num_blocks,
    block_size, Hkv, D]`. Values may have a head dim of their own, `Dv` (MLA,
    `mla.py`: keys the whole latent, values its first dims, views of one cache);
    the output then has `Dv`. `logits_soft_cap`: scores become `cap * tanh(s / cap)`
    (`inf`: no cap, the limit). `sinks`: `[Hq]` one logit per head that joins
    every softmax denominator (`+inf`: the sink takes all the weight, output 0 on
    that head; `-inf`: no sink). Returns `[T, Hq, Dv]` in query's dtype.

    fp8 KV cache: key_cache/value_cache may be `float8_e4m3fn` or `float8_e5m2`
    (query/key/value stay in the model dtype); a cached key is `stored *
    k_scale`, a value `stored * v_scale` (`paths/kv_quant.py`: a float or
    one-element tensor per tensor, or a `[num_blocks, b, h, d]` tensor per
    block; None: 1). The paths dequantize only the blocks they gathered. The
    new tokens come from `key`/`value` as given: pass them as the cache stores
    them (dequantized) for results that do not depend on how a prompt was
    chunked (the vLLM plugin does).
    """
    q, k, v = checked_step(query, key, value, key_cache, value_cache, batch, scale, logits_soft_cap, sinks, k_scale,
                           v_scale)
    return attend_step(q, k, v, key_cache, value_cache, batch, scale, logits_soft_cap=logits_soft_cap,
                       sinks=sinks, k_scale=k_scale, v_scale=v_scale)[:query.shape[0]]


def checked_step(query, key, value, key_cache, value_cache, batch, scale, logits_soft_cap=None, sinks=None,
                 k_scale=None, v_scale=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What `unified_attention` does before `attend_step`, host-side and eager (`graphs.compiled_attention`
    too, outside its compiled function): the checks, then q/k/v padded to the bucket's rows."""
    check_inputs(query, key, value, key_cache, value_cache, batch, scale, logits_soft_cap, sinks)
    check_scale("k_scale", k_scale, key_cache)
    check_scale("v_scale", v_scale, value_cache)
    t, padded = query.shape[0], batch.bucket.query_len
    if t < padded:
        query, key, value = (F.pad(x, (0, 0, 0, 0, 0, padded - t)) for x in (query, key, value))
    return query, key, value


def attend_step(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                value_cache: torch.Tensor, batch: UnifiedBatch, scale: float, *,
                logits_soft_cap: float | None = None, sinks: torch.Tensor | None = None,
                k_scale=None, v_scale=None, dense_decodes: bool = False,
                self_slots: torch.Tensor | None = None, prompt_route: bool = True) -> torch.Tensor:
    """`unified_attention` as a server's layers call it: no checks, no copies of q/k/v.

    The inputs were checked once for the step (`check_inputs` on its first
    layer: every layer of a KV cache group has the same shapes) and have the
    bucket's `query_len` rows already (views of the runner's padded tensors, or
    `BucketRows`). Returns `[query_len, Hq, Dv]` in query's dtype. Inputs that
    were not checked and fail in torch are checked then: the error names the
    bad argument (nothing is checked on the way to a result).

    `dense_decodes`: the decodes of a step of decodes, or of decodes beside prompts on the prompt route,
    on the CPU run as one SDPA over a padded table of their keys (`paths/decodes.py`: eager CPU steps
    pay per op; vLLM's CPU platform sets it), the prompts as one `prompt_final` call;
    `self_slots`: there, the cache slots the new tokens' K/V were written to (`[tokens]`, all >= 0).
    `prompt_route=False`: the prompt route's final rows are the caller's (MLA's expanded form,
    `mla_prompts.py`): not computed, those rows of the output hold no attention (zeros or the self pair).
    """
    try:
        return run_step(query, key, value, key_cache, value_cache, batch, scale, logits_soft_cap=logits_soft_cap,
                        sinks=sinks, k_scale=k_scale, v_scale=v_scale, dense_decodes=dense_decodes,
                        self_slots=self_slots, prompt_route=prompt_route)
    except (AttributeError, IndexError, NotImplementedError, RuntimeError, TypeError):
        bad = input_error(query, key, value, key_cache, value_cache, batch, scale, logits_soft_cap, sinks, k_scale,
                          v_scale)
        if bad is None:  # the inputs are sound: the failure is torch's own
            raise
        raise bad from None


def run_step(query, key, value, key_cache, value_cache, batch, scale, *, logits_soft_cap=None, sinks=None,
             k_scale=None, v_scale=None, dense_decodes=False, self_slots=None, prompt_route=True) -> torch.Tensor:
    """`attend_step`'s work, the function `graphs.compiled_attention` compiles (its inputs checked eagerly)."""
    if logits_soft_cap is not None and math.isinf(logits_soft_cap):
        logits_soft_cap = None  # cap * tanh(s / cap) -> s; computing it would give inf * 0 = NaN
    padded = query.shape[0]
    prompts = not isinstance(batch, InvariantBatch) and batch.bucket.num_prompts > 0
    final = prompts and final_rows(batch, query, logits_soft_cap, sinks)
    if not prompt_route and prompts and not final:
        raise ValueError("prompt_route=False needs the prompt route's final form (no soft cap or sinks, fused "
                         "kernels on): its partial form is merged with the other paths")
    flash = final and prompt_flash(batch, query, value.shape[-1], logits_soft_cap)
    if final and batch.plan.prompts_only:  # every token on the prompt route: one call, nothing else
        if not prompt_route:
            return query.new_zeros((padded, query.shape[1], value.shape[-1]))
        rows = prompt_final(query, key, value, key_cache, value_cache, batch, scale, k_scale, v_scale, flash)
        if batch.plan.prompt_grid:  # the rows are the grid: written where they are, no gather
            return grid_rows(rows, batch, padded)
        return write_rows(None, batch.prompt_rows, rows, padded)
    if (dense_decodes and not isinstance(batch, InvariantBatch) and (final or not prompts)
            and dense_decodes_apply(batch, query, key_cache, logits_soft_cap, sinks, k_scale)):
        out = dense_decodes_attention(query, key, value, key_cache, value_cache, batch, scale, self_slots)
        if final and prompt_route:  # the prompts' rows, final, beside the decodes'
            out = write_rows(out, batch.prompt_rows.clamp(max=padded),
                             prompt_final(query, key, value, key_cache, value_cache, batch, scale, k_scale, v_scale,
                                          flash))
        return out
    if isinstance(batch, InvariantBatch):  # one fixed computation per request: see plan/invariant.py
        sink = None if sinks is None else sink_partial(sinks, padded, value.shape[2], compute_dtype(query.dtype))
        return invariant_output(query, key, value, key_cache, value_cache, batch, scale, logits_soft_cap, sink,
                                k_scale, v_scale)
    alone = not prompts and sinks is None and not batch.pieces  # (the paths' results are all there is)
    partials = [p for p in _run_paths(query, key, value, key_cache, value_cache, batch, scale, logits_soft_cap,
                                      k_scale, v_scale, prompts_merged=prompts and not final, alone=alone)
                if p is not None]
    if prompts and not final:
        partials.append(prompt_partial(query, key, value, key_cache, value_cache, batch, scale, logits_soft_cap,
                                       k_scale, v_scale))
    if batch.pieces:  # a step split under the gather cap (plan/split.py): each pair is in one piece
        t = batch.num_tokens
        partials = [_first_rows(p, t) for p in partials]
        partials += _piece_partials(query[:t], key[:t], value[:t], key_cache, value_cache, batch.pieces, scale,
                                    logits_soft_cap, k_scale, v_scale)
        padded = t
    if sinks is not None:
        partials.append(sink_partial(sinks, padded, value.shape[2], compute_dtype(query.dtype)))
    if isinstance(partials[0], Final):  # (only given alone: `_run_paths`)
        out = partials[0].out
    else:
        out = merge_rows(partials, padded, query.dtype)  # (the tile paths' rows `Scattered`)
    if out.shape[0] < query.shape[0]:  # a split step: the rows past its tokens are padding
        out = F.pad(out, (0, 0, 0, 0, 0, query.shape[0] - out.shape[0]))
    if final and prompt_route:  # the prompt route's rows are final: written over what the other paths gave them
        out = write_rows(out, batch.prompt_rows.clamp(max=out.shape[0]),
                         prompt_final(query, key, value, key_cache, value_cache, batch, scale, k_scale, v_scale,
                                      flash))
    return out


class BucketRows:
    """q/k/v with the bucket's rows, for `attend_step`, without allocating per layer.

    A runner that pads its token batch to the bucket (graphs do) hands at least
    `rows` rows: the first `rows` are used as views, no copy. A runner that
    hands only the step's tokens (vLLM on the CPU) gets them copied into
    buffers kept from layer to layer and step to step, the padding rows zeroed
    (what `unified_attention`'s pad gives)."""

    def __init__(self):
        self._buffers: dict[tuple, torch.Tensor] = {}

    def __call__(self, name: str, x: torch.Tensor, rows: int) -> torch.Tensor:
        t = x.shape[0]
        if t >= rows:
            return x[:rows]
        key = (name, x.shape[1:], x.dtype, x.device)
        buf = self._buffers.get(key)
        if buf is None or buf.shape[0] < rows:
            buf = self._buffers[key] = x.new_zeros((max(rows, 2 * (0 if buf is None else buf.shape[0])),
                                                    *x.shape[1:]))
        out = buf[:rows]
        out[:t].copy_(x)
        out[t:].zero_()
        return out


def _first_rows(p: Partial | Scattered, rows: int) -> Partial | Scattered:
    return Scattered(p.rows, p.index.clamp(max=rows)) if isinstance(p, Scattered) else Partial(*(x[:rows] for x in p))


def _piece_partials(query, key, value, key_cache, value_cache, pieces, scale, cap, k_scale, v_scale
                    ) -> list[Partial]:
    """The shared and unique pairs of the further pieces of a split step, each piece at its own bucket
    (the self and causal pairs are all in the first piece, the batch itself)."""
    t, out = query.shape[0], []
    for piece in pieces:
        pad = piece.bucket.query_len - t
        q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)) if pad else x for x in (query, key, value))
        paths = _run_paths(q, k, v, key_cache, value_cache, piece, scale, cap, k_scale, v_scale, new_tokens=False)
        out += [_first_rows(p, t) for p in paths if p is not None]
    return out


def _run_paths(query, key, value, key_cache, value_cache, batch, scale, cap, k_scale=None, v_scale=None,
               new_tokens: bool = True, prompts_merged: bool = False, alone: bool = False):
    """Which paths run, all conditions in one place (`new_tokens=False`: the further pieces of a split
    step, whose self and causal pairs are in the first piece: 1 and 2 do not run; `alone`: the caller
    merges nothing else, so a path that turns out to be the only one may return its rows `Final`):

    0. (in `attend_step`) the prompt route, when the bucket has prompts (`paths/prompts.py`): rows
       final from one fused SDPA call (then a step of prompts alone runs nothing else), or a Partial.
    1. self (each token with its own key): always; it is elementwise. MLA's latent unique routes (4.)
       take it inside their one Partial row per token, so it does not run beside them; nor 1 and 2 where 4.'s
       units take the requests' new pairs (`units_take_new_pairs`).
    2. causal tiles: when the phase has 'c' (a request off the prompt route has two or more new tokens); in a
       verify step MLA's kernel and chunks routes take them with their units (`paths/mla_drafts.py`). With CUDA
       flash (`paths/fused.py`) 1 and 2 are one fused varlen call (not when the prompt route merges a Partial,
       `prompts_merged`: flash's segments would count its causal pairs again).
    3. shared tiles: when the phase has 's' (a cached block is seen by several tokens); tiles of a small
       group (at most `unique.KERNEL_SHARED_MAX_ROWS` rows) with the Triton kernel of 4: as further slots of
       that one kernel call, each row reading the tile's blocks (4 then runs nothing else); MLA's latent
       cache: each tile's rows x heads as one product (`paths/mla_shared.py`);
       through flash when the plan's tiles each see one key prefix (`shared_prefix_visible`).
    4. unique blocks: when the phase has 'u' (a cached block is seen by one token); with CUDA flash and a
       bf16, fp16 or fp8 cache, through the Triton kernel that reads the blocks as stored
       (`kernel_unique_applies`: Triton importable; measured faster at every block size); else through
       flash from the measured block size up (`fused_unique_applies`); else the matmul tiles. MLA's latent cache (values the first dims of
       the keys) first: a Triton kernel on CUDA, one gather and two batched matmuls per decode step on the
       CPU, or chunks of each token's blocks in bucket shapes elsewhere (`paths/mla_decode.py: mla_unique_route`);
       the kernel takes the shared tiles of 3. too (`mla_kernel_takes_shared`). On HPU the causal and shared
       tiles run through FusedSDPA inside their paths (`hpu.py`). fp8 caches are dequantized after each
       path's gather or slice (`read_blocks`), or inside the kernel of 4. A path without work returns None,
       so the phase string and the tensors cannot disagree.
    """
    phase = batch.phase
    # flash takes one head dim: MLA's latent (values narrower than keys) runs the tiles and the unique kernel
    flash = value.shape[-1] == query.shape[-1] and kernel_for(batch, query, cap) == "flash"
    # MLA's shared tiles go to its kernel with the unique pairs (`paths/mla_decode.py: mla_kernel_takes_shared`)
    shared_to_kernel = phase[1] == "s" and mla_kernel_takes_shared(batch)
    mla = (mla_unique_route(batch, query, key_cache, value_cache, cap, k_scale, v_scale)
           if new_tokens and (phase[2] == "u" or shared_to_kernel) else None)
    mla_shared_in_kernel = shared_to_kernel and mla == "kernel"
    mla = mla if phase[2] == "u" or mla_shared_in_kernel else None
    drafts = mla in ("kernel", "chunks") and batch.plan.drafts_in_units and batch.plan.unique_units > 1  # (2.)
    kernel = flash and kernel_unique_applies(key_cache, value_cache)
    # A small group's shared tiles (parallel sampling) as more slots of the unique kernel: one kernel for
    # the step's cached keys (`paths/unique.py: kernel_takes_shared`).
    shared_in_kernel = kernel and phase[1] == "s" and kernel_takes_shared(batch)
    # A request's self and causal pairs in the unique units (the kernel's, with shared cells one-token units only)
    new_in_units = (new_tokens and (phase[2] == "u" or shared_in_kernel) and not mla and (kernel or not flash)
                    and units_take_new_pairs(batch, kernel) and not (shared_in_kernel and batch.plan.unique_units > 1))
    new = (key, value) if new_in_units else None  # (for 4.)
    if not new_tokens or new_in_units:
        pass
    elif flash and phase[0] == "c" and not batch.plan.bidirectional and not prompts_merged:
        # flash's segments are whole requests (causal ones: an encoder-only step runs the tiles)
        yield fused_causal_partial(query, key, value, batch, scale)
    else:
        if not mla:  # (MLA's latent routes take each token's own pair too: paths/mla_decode.py)
            yield self_partial(query, key, value, scale, cap)
        if phase[0] == "c" and not drafts:
            yield causal_partial(query, key, value, batch, scale, cap)
    # Routes that read a block per token take a unique unit (a request's drafts) as one slot per token.
    tokens = query.shape[0]
    if shared_in_kernel:
        yield kernel_unique_partial(query, key_cache, value_cache, per_token(batch, tokens), scale, k_scale, v_scale,
                                    shared=True, new=new, final=alone and new is not None)
    elif phase[1] == "s" and not mla_shared_in_kernel:
        if mla_shared_applies(batch, key_cache, value_cache, cap, k_scale, v_scale):  # paths/mla_shared.py
            yield latent_shared_partial(query, key_cache, value_cache.shape[-1], batch, scale, k_scale)
        elif flash and batch.plan.shared_prefix_visible:
            yield fused_shared_partial(query, key_cache, value_cache, batch, scale, k_scale, v_scale)
        else:
            yield shared_partial(query, key_cache, value_cache, batch, scale, cap, k_scale, v_scale)
    if (phase[2] == "u" or mla_shared_in_kernel) and not shared_in_kernel:
        if mla:  # MLA's latent: one Partial row per token, the latent read once, the self pair inside
            run = {"kernel": kernel_mla_partial, "dense": dense_mla_partial, "chunks": chunks_mla_partial}[mla]
            extra = {"shared": True} if mla_shared_in_kernel else {"kv_scale": k_scale} if mla != "kernel" else {}
            if mla == "kernel" and alone and (phase[0] == "-" or drafts) and (phase[1] == "-" or mla_shared_in_kernel):
                extra["final"] = True  # (the only path: the kernel normalizes its rows itself)
            if drafts:  # (the units as they are: the route reads them, `paths/mla_drafts.py`)
                extra["drafts"] = True
            units = batch if drafts else per_token(batch, tokens)
            yield run(query, key_cache, value_cache.shape[-1], units, scale, key, **extra)
        elif kernel:  # (with the units' new pairs and no shared tiles, the step's only path: its rows final)
            yield kernel_unique_partial(query, key_cache, value_cache, batch, scale, k_scale, v_scale, new=new,
                                        final=alone and new is not None and phase[1] == "-")
        elif flash and fused_unique_applies(batch, key_cache):
            yield fused_unique_partial(query, key_cache, value_cache, per_token(batch, tokens), scale, k_scale, v_scale)
        else:
            yield unique_partial(query, key_cache, value_cache, batch, scale, cap, k_scale, v_scale, new=new)


def input_error(*args) -> ValueError | None:
    """The error `checked_step` gives these inputs (its arguments), or None when they pass."""
    try:
        checked_step(*args)
    except ValueError as exc:
        return exc
    return None


def check_tensor(name: str, x, dims: int) -> None:
    """A ValueError naming `name` unless `x` is a torch tensor of `dims` dimensions (a list or a numpy array
    is not: the device runs tensors)."""
    if not isinstance(x, torch.Tensor) or x.dim() != dims:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        hint = " (torch.from_numpy makes one)" if isinstance(x, np.ndarray) else ""
        raise ValueError(f"{name} must be a {dims}-D tensor, got {shape}{hint}")


def check_inputs(query, key, value, key_cache, value_cache, batch, scale, cap, sinks) -> None:
    """Clear errors naming the field, before any device work; host-side facts only (no sync).
    `unified_attention` runs it on every call; a server's layers once per step (see `attend_step`)."""
    if not isinstance(batch, UnifiedBatch):
        raise ValueError(f"batch must be a UnifiedBatch from build_unified_batch, got {type(batch).__name__}")
    for name, x, dims in (("query", query, 3), ("key", key, 3), ("value", value, 3), ("key_cache", key_cache, 4),
                          ("value_cache", value_cache, 4)):
        check_tensor(name, x, dims)
    dtypes = {n: x.dtype for n, x in (("query", query), ("key", key), ("value", value), ("key_cache", key_cache),
                                      ("value_cache", value_cache))}
    fp8_caches = is_fp8(key_cache.dtype) and key_cache.dtype == value_cache.dtype  # dequantized as read
    if len({d for n, d in dtypes.items() if not (fp8_caches and n.endswith("_cache"))}) != 1:
        raise ValueError("mixed dtypes: " + ", ".join(f"{n} {str(d).replace('torch.', '')}" for n, d in dtypes.items()))
    if not query.dtype.is_floating_point:
        raise ValueError(f"query dtype must be floating point, got {query.dtype}")
    t, hq, d = query.shape
    if hq == 0 or d == 0:
        raise ValueError(f"query has {hq} heads and head_dim {d}: both must be >= 1")
    if t not in (batch.num_tokens, batch.bucket.query_len):
        raise ValueError(f"query has {t} tokens but the batch has {batch.num_tokens} "
                         f"(padded: {batch.bucket.query_len})")
    hkv, dv = key.shape[1], value.shape[-1]
    for name, x, dim in (("key", key, d), ("value", value, dv)):
        if tuple(x.shape) != (t, hkv, dim):
            raise ValueError(f"{name} shape {tuple(x.shape)} must be {(t, hkv, dim)} (tokens, kv heads, head_dim)")
    if not 1 <= dv <= d:
        raise ValueError(f"value head_dim {dv} must be in [1, {d}] (the query/key head_dim; smaller for MLA)")
    if hkv == 0:
        raise ValueError(f"key has 0 heads (shape {tuple(key.shape)})")
    if hq % hkv:
        raise ValueError(f"query heads {hq} must be a multiple of kv heads {hkv}")
    num_blocks = key_cache.shape[0]
    for name, x, dim in (("key_cache", key_cache, d), ("value_cache", value_cache, dv)):
        expected = (num_blocks, batch.block_size, hkv, dim)
        if tuple(x.shape) != expected:
            raise ValueError(f"{name} shape {tuple(x.shape)} must be {expected} "
                             "(num_blocks, block_size, kv heads, head_dim)")
    if batch.max_block_id >= num_blocks:
        raise ValueError(f"block_table needs block id {batch.max_block_id} but key_cache has {num_blocks} blocks")
    if batch.unique_blocks is None and batch.bucket.num_unique_blocks > num_blocks:
        raise ValueError(f"unique slice of {batch.bucket.num_unique_blocks} blocks is larger than the cache "
                         f"({num_blocks} blocks): pad to a smaller bucket or use unique_layout='gather'")
    devices = {query.device, key.device, value.device, key_cache.device, value_cache.device, batch.device}
    if len(devices) != 1:
        for name, x in (("key", key), ("value", value), ("key_cache", key_cache), ("value_cache", value_cache)):
            if x.device != query.device:
                raise ValueError(f"{name} is on {x.device} but query is on {query.device}")
        raise ValueError(f"batch is on {batch.device} but the tensors are on {query.device}: build the batch "
                         "with device= or call batch.to(device)")
    if not (_is_real(scale) and math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a finite positive float, got {scale!r}")
    if cap is not None and not (_is_real(cap) and cap > 0):  # inf allowed: no cap
        raise ValueError(f"logits_soft_cap must be None or a positive float, got {cap!r}")
    if sinks is not None:
        if not isinstance(sinks, torch.Tensor) or tuple(sinks.shape) != (hq,):
            shape = tuple(sinks.shape) if isinstance(sinks, torch.Tensor) else type(sinks).__name__
            raise ValueError(f"sinks must be a tensor of shape ({hq},) (one logit per query head), got {shape}")
        if not sinks.dtype.is_floating_point:
            raise ValueError(f"sinks must be a floating-point tensor, got {sinks.dtype}")
        if sinks.device != query.device:
            raise ValueError(f"sinks are on {sinks.device} but the query is on {query.device}")


def _is_real(x) -> bool:
    """A Python or numpy real number, not a bool (True is not a scale)."""
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, (bool, np.bool_))
