"""A scheduler step as vllm-gaudi's input batch holds it, and the model inputs of its one unified batch.

Host arrays only (numpy; torch for the per-request view of the hidden states): what the unified
runner (`hpu_runner.py`) reads from vllm-gaudi's `HPUInputBatch` and lays out per token.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class HpuStep:
    """A scheduler step as the runner's input batch holds it, requests in input-batch order::

        |---- context_len (num_computed_tokens) ----|-- query_len (scheduled) --|
    """

    req_ids: list[str]
    query_lens: np.ndarray  #: [R] int64 tokens scheduled this step
    context_lens: np.ndarray  #: [R] int64 tokens already in the KV cache
    block_tables: list[np.ndarray]  #: per KV cache group, [R, max_blocks] int64 physical block ids

    @property
    def num_tokens(self) -> int:
        return int(self.query_lens.sum())


def step_from_input_batch(input_batch, num_scheduled_tokens, resolve_blocks=None) -> HpuStep:
    """The step of `input_batch` (vllm-gaudi's `HPUInputBatch`) for the scheduler's
    `num_scheduled_tokens` (request id -> tokens). `resolve_blocks(table)` maps block ids
    through vllm-gaudi's defragmenter when it is on."""
    n = input_batch.num_reqs
    req_ids = list(input_batch.req_ids[:n])
    query_lens = np.fromiter((num_scheduled_tokens[r] for r in req_ids), dtype=np.int64, count=n)
    context_lens = input_batch.num_computed_tokens_cpu[:n].astype(np.int64)
    tables = []
    for table in input_batch.block_table.block_tables:
        bt = table.get_numpy_array()[:n].astype(np.int64)
        tables.append(bt if resolve_blocks is None else resolve_blocks(bt))
    return HpuStep(req_ids, query_lens, context_lens, tables)


def slot_mapping(step: HpuStep, block_table: np.ndarray, block_size: int, padded_len: int,
                 pad_slot: int) -> np.ndarray:
    """[padded_len] cache slot of every new token (requests in order), then `pad_slot` for padding rows."""
    req = np.repeat(np.arange(len(step.query_lens)), step.query_lens)
    starts = np.cumsum(step.query_lens) - step.query_lens
    pos = step.context_lens[req] + np.arange(len(req)) - starts[req]
    slots = np.full(padded_len, pad_slot, dtype=np.int64)
    slots[:len(req)] = block_table[req, pos // block_size] * block_size + pos % block_size
    return slots


def token_positions(step: HpuStep, padded_len: int) -> tuple[np.ndarray, np.ndarray]:
    """(request index, position) of every new token; padding rows: request 0, position 0."""
    req = np.repeat(np.arange(len(step.query_lens)), step.query_lens)
    starts = np.cumsum(step.query_lens) - step.query_lens
    pos = np.zeros(padded_len, dtype=np.int64)
    pos[:len(req)] = step.context_lens[req] + np.arange(len(req)) - starts[req]
    index = np.zeros(padded_len, dtype=np.int64)
    index[:len(req)] = req
    return index, pos


class PerRequestRows:
    """The hidden states of one flattened step, indexed by request like vllm-gaudi's per-request
    prefill batches (`rows[i]` is request `first + i`'s `[query_len, hidden]`; `first`: the decodes
    that vllm-gaudi's sampling lists apart under speculative decoding): its prompt-logprobs code reads them so."""

    def __init__(self, hidden: torch.Tensor, query_lens: np.ndarray, first: int = 0):
        self.hidden = hidden
        self.starts = (np.cumsum(query_lens) - query_lens).tolist()[first:]
        self.lens = query_lens.tolist()[first:]

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.hidden[self.starts[i]:self.starts[i] + self.lens[i]]

    def __len__(self) -> int:
        return len(self.lens)
