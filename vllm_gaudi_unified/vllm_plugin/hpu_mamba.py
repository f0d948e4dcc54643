"""Mamba2 layers of hybrid models (Granite-4.0-h) on the Gaudi path: vllm-gaudi's op over the unified step.

vllm-gaudi's Mamba2 op (`HPUMambaMixer2`) reads one batch metadata object of its runner's from the forward
context, and one call takes either decodes (one token each, state loaded and stored per request) or exactly
one prompt (its conv kernel refuses more than one sequence; its chunked scan wants the prompt padded to whole
Mamba chunks): vllm-gaudi's runner never merges two prompts of a hybrid. The unified runner keeps its one flat
step for the attention layers and gives each Mamba layer what vllm-gaudi's runner gives it, from the same step:
`mamba_step` plans the step's calls on the host (the decodes together, then each prompt padded to whole
chunks, with state indices, chunk-to-block map and conv offsets as vllm-gaudi's prefix caching reads them), and
`serve_mamba_layers` runs each Mamba layer over those calls, its rows gathered from and written back into the
flat step (padding rows stay zero). GatedDeltaNet layers (Qwen3-Next, Qwen3.5) stay refused at start-up.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import torch


@dataclass
class MambaCall:
    """One call of vllm-gaudi's Mamba2 op: which rows of the flat step it takes, padded to how many."""

    rows: torch.Tensor  #: [n] int64 flat-step rows, in the order the op sees them
    padded: int  #: rows the op sees (a prompt padded to whole Mamba chunks; decodes: n)
    metadata: SimpleNamespace  #: the fields of vllm-gaudi's batch metadata the op reads


@dataclass
class MambaStep:
    """The step's Mamba calls; what the forward context holds for a Mamba layer under the unified runner."""

    calls: list[MambaCall]


def _cdiv(a, b):
    return -(-a // b)


def mamba_step(runner, query_lens: np.ndarray, context_lens: np.ndarray) -> MambaStep:
    """Plan the step's Mamba calls as vllm-gaudi's runner would split it (requests in input-batch order):
    requests with one token and a state (decodes) in one call, then one call per other request (a prompt or a
    prompt chunk), padded to whole Mamba chunks."""
    chunk = runner.mamba_chunk_size
    block = runner.cache_config.mamba_block_size
    caching = runner.use_prefix_caching
    device = runner.device
    starts = np.cumsum(query_lens) - query_lens
    # vllm-gaudi's block indices: the state after the computed tokens is loaded, after the scheduled ones stored
    last_computed = np.maximum(_cdiv(context_lens, block) - 1, 0)
    first_scheduled = _cdiv(context_lens + 1, block) - 1
    last_scheduled = np.maximum(_cdiv(context_lens + query_lens, block) - 1, 0)

    def indices(reqs, offsets):
        offsets = offsets if caching else np.zeros_like(offsets)
        return runner.prepare_mamba_state_idxs(reqs.tolist(), torch.from_numpy(offsets), len(reqs)).to(device)

    calls = []
    decodes = np.flatnonzero((query_lens == 1) & (context_lens > 0))
    if len(decodes):
        n = len(decodes)
        md = SimpleNamespace(is_prompt=False, load_indices_tensor=indices(decodes, last_computed[decodes]),
                             store_indices_tensor=indices(decodes, last_scheduled[decodes]),
                             query_start_loc_p=torch.arange(n + 1, dtype=torch.int32, device=device),
                             prep_initial_states=None, has_initial_states_p=None, last_chunk_indices_p=None,
                             padding_mask_flat=None)  # (prompt fields, read but unused by decodes)
        calls.append(MambaCall(torch.from_numpy(starts[decodes]).to(device), n, md))
    prompts = np.setdiff1d(np.flatnonzero(query_lens > 0), decodes)
    for i in prompts:
        blocks = int(last_computed[i]), int(first_scheduled[i]), int(last_scheduled[i])
        calls.append(_prompt_call(runner, i, int(starts[i]), int(query_lens[i]), int(context_lens[i]), blocks,
                                  indices, chunk, block, caching))
    return MambaStep(calls)


def _prompt_call(runner, i, start, q, ctx, blocks, indices, chunk, block, caching) -> MambaCall:
    """Request `i`'s `q` tokens after `ctx` computed ones (flat rows from `start`) as one prompt call of
    vllm-gaudi's op; `blocks`: the indices in its block table of the state it loads and of the first and last
    blocks its tokens reach."""
    device = runner.device
    loaded, first, last = blocks
    padded = _cdiv(q, chunk) * chunk
    chunks = padded // chunk
    req = np.array([i])
    mask = torch.zeros(padded, 1, dtype=runner.dtype)
    mask[:q] = 1
    md = SimpleNamespace(
        is_prompt=True, prep_initial_states=ctx > 0,
        load_indices_tensor=indices(req, np.array([loaded])),
        store_indices_tensor=indices(req, np.array([last])),
        has_initial_states_p=torch.tensor([ctx > 0], device=device),
        query_start_loc_p=torch.tensor([0, q], dtype=torch.int32, device=device),
        last_chunk_indices_p=torch.tensor([chunks - 1], dtype=torch.int32, device=device),
        padding_mask_flat=mask.to(device), blocks_caching_range=None, mamba_chunks_to_block_mapping=None,
        seqlens_offsets_for_blocks=None)
    if caching:
        if block % chunk:
            raise ValueError(f"mamba_block_size={block} is not a multiple of the Mamba chunk size {chunk}: "
                             "vllm-gaudi's Mamba2 op caches states at chunk ends")
        if last > first and ctx % chunk:
            raise NotImplementedError(
                f"a prompt chunk starting at token {ctx} (not a multiple of the Mamba chunk size {chunk}) crosses "
                f"a {block}-token block boundary: vllm-gaudi's Mamba2 op stores a block's state at a chunk end, "
                "which falls elsewhere (vLLM's 'align' prefix caching ends such a chunk at the boundary)")
        pad = runner._MAMBA_PAD_BLOCK_ID
        n_blocks, most = last - first + 1, _cdiv(padded, block) + 1
        stride = block // chunk
        # the chunk (counted from the scheduled tokens) whose end is each block's boundary; the last block's
        # state is the last chunk's (the padding rows leave the state as it is)
        ends = np.minimum(np.arange(n_blocks) * stride + (first + 1) * stride - 1 - ctx // chunk, chunks - 1)
        ranges = np.full((len(runner.input_batch.block_table.block_tables), most), pad, dtype=np.int32)
        maps = np.full((len(ranges), chunks), pad, dtype=np.int32)
        for g, table in enumerate(runner.input_batch.block_table.block_tables):
            blocks = table.get_numpy_array()[i, first:last + 1]
            ranges[g, :n_blocks] = blocks
            maps[g, ends] = blocks
        # the conv state at each block boundary inside the scheduled tokens, then at their end
        offsets = np.arange(block - ctx % block, q, block).tolist() + [q]
        offsets += [q] * (most - len(offsets))
        md.blocks_caching_range = torch.from_numpy(ranges).to(device)
        md.mamba_chunks_to_block_mapping = torch.from_numpy(maps).to(device)
        md.seqlens_offsets_for_blocks = torch.tensor(offsets, dtype=torch.int32, device=device)
    return MambaCall(torch.arange(start, start + q, device=device), padded, md)


def mamba_layer_names(vllm_config) -> list[str]:
    """The model's vllm-gaudi Mamba2 layers (`HPUMambaMixer2`), by their forward-context names (none where
    vllm-gaudi's ops module, which registers the layer, was never imported)."""
    ops = sys.modules.get("vllm_gaudi.ops.hpu_mamba_mixer2")
    if ops is None:
        return []
    layers = vllm_config.compilation_config.static_forward_context
    return [name for name, layer in layers.items() if isinstance(layer, ops.HPUMambaMixer2)]


def state_layer_names(vllm_config, groups, buckets: str | None = None) -> list[str]:
    """The layers of the KV cache groups that hold states (`MambaSpec`), all vllm-gaudi Mamba2 layers; or a
    start-up error naming what is not served: another state layer (GatedDeltaNet, short convolutions, ...),
    a bucket plan (`buckets`) or speculative decoding beside Mamba layers."""
    from vllm.v1.kv_cache_interface import MambaSpec

    names = [n for g in groups if isinstance(g.kv_cache_spec, MambaSpec) for n in g.layer_names]
    if not names:
        return names
    served = set(mamba_layer_names(vllm_config))
    layers = vllm_config.compilation_config.static_forward_context
    unset = "Unset VLLM_GAUDI_UNIFIED (or set it to 0) to use vllm-gaudi's own attention"
    for name in names:
        if name not in served:
            raise NotImplementedError(
                f"layer {name} ({type(layers[name]).__name__}, a state layer beside attention): the unified runner "
                "on Gaudi serves Mamba2 layers only (vllm-gaudi's HPUMambaMixer2, Granite-4.0-h style); "
                "GatedDeltaNet and other state layers read vllm-gaudi's own batch metadata, which it does not "
                f"build. {unset}")
    if buckets:
        raise NotImplementedError(f"a bucket plan ({buckets}) for a model with Mamba2 layers: their calls (each "
                                  "prompt apart, padded to whole Mamba chunks) follow the step, not its bucket, so no "
                                  "graph per bucket covers the model; leave VLLM_GAUDI_UNIFIED_BUCKETS unset")
    if getattr(vllm_config, "speculative_config", None) is not None:
        raise NotImplementedError("speculative decoding with Mamba2 layers: vllm-gaudi's Mamba2 op keeps one state "
                                  f"per request, not one per draft position. {unset}")
    return names


def serve_mamba_layers(vllm_config) -> int:
    """Make every Mamba2 layer run the step's `MambaStep` calls when the forward context holds one for it
    (the unified runner's steps); vllm-gaudi's op as it is otherwise (its profile run). Returns how many."""
    layers = vllm_config.compilation_config.static_forward_context
    names = mamba_layer_names(vllm_config)
    for name in names:
        layer = layers[name]
        layer.forward = _per_call_forward(layer, layer.forward)
    return len(names)


def _per_call_forward(layer, forward):
    from vllm.forward_context import get_forward_context

    def run(hidden_states: torch.Tensor, mup_vector: torch.Tensor | None = None) -> torch.Tensor:
        context = get_forward_context()
        planned = context.attn_metadata
        step = planned.get(layer.prefix) if isinstance(planned, dict) else None
        if not isinstance(step, MambaStep):
            return forward(hidden_states, mup_vector)
        flat = hidden_states.reshape(-1, hidden_states.shape[-1])
        out = torch.zeros_like(flat)
        try:
            for call in step.calls:
                x = flat.new_zeros(call.padded, flat.shape[-1])
                x[:len(call.rows)] = flat[call.rows]
                context.attn_metadata = call.metadata
                y = forward(x, mup_vector)
                out[call.rows] = y.reshape(-1, y.shape[-1])[:len(call.rows)]
        finally:
            context.attn_metadata = planned
        return out.view_as(hidden_states)

    return run
