"""The unified batch: one step's plan as device tensors, passed explicitly from plan to run."""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field, fields, replace

import numpy as np
import torch

from vllm_gaudi_unified.bucket import Bucket, with_prompts
from vllm_gaudi_unified.copies import KeptCopy, to_device
from vllm_gaudi_unified.log import get_logger
from vllm_gaudi_unified.plan import InvariantPlan, PathWork, PlanBuffers, PlanOptions, StepPlan, pad_plan, plan_step
from vllm_gaudi_unified.plan.arrays import trusted
from vllm_gaudi_unified.plan.options import DEFAULT_OPTIONS, on_route
from vllm_gaudi_unified.plan.split import split_plan

logger = get_logger(__name__)


@dataclass(frozen=True, eq=False)
class UnifiedBatch:
    """A planned step on one device. Index tensors are int64; a row index equal to
    `bucket.query_len` means "no row" (padding). Sizes come from `bucket`."""

    plan: StepPlan  #: the host-side plan (numpy arrays, sizes, work accounting)
    #: further calls of a step split under a plan's gather cap (`plan/split.py`): their shared and unique
    #: pairs merge into this batch's result; empty for every step within the cap
    pieces: tuple = field(default=(), kw_only=True)
    token_seg_start: torch.Tensor  #: [query_len] first flattened token of each token's request
    causal_q_start: torch.Tensor  #: [num_causal_tiles] first query row of each causal tile
    causal_k_start: torch.Tensor  #: [num_causal_tiles] first key of each causal tile
    shared_rows: torch.Tensor  #: [shared tiles, shared_rows] query token per tile row
    shared_blocks: torch.Tensor  #: [shared tiles, blocks_per_tile] cache block per tile column
    shared_lo: torch.Tensor  #: [shared tiles, shared_rows, blocks_per_tile] first visible slot
    shared_hi: torch.Tensor  #: [shared tiles, shared_rows, blocks_per_tile] end of visible slots
    unique_rows: torch.Tensor  #: [num_unique_blocks] the token of each unique block slot
    unique_blocks: torch.Tensor | None  #: [num_unique_blocks] block ids, or None: slice [0, num_unique_blocks)
    unique_lo: torch.Tensor  #: [num_unique_blocks]
    unique_hi: torch.Tensor  #: [num_unique_blocks]
    logits_indices: torch.Tensor  #: [num_logits] last new token of each request (padding: 0)
    #: the prompt route (`plan/prompts.py`; None in an invariant batch): token per row, context blocks,
    #: context lengths and new-token counts of each prompt
    prompt_rows: torch.Tensor | None = field(default=None, kw_only=True)
    prompt_blocks: torch.Tensor | None = field(default=None, kw_only=True)
    prompt_ctx: torch.Tensor | None = field(default=None, kw_only=True)
    prompt_len: torch.Tensor | None = field(default=None, kw_only=True)
    #: the prompt route's additive mask `[P, 1, Qp, Kp]` (0 / -inf in the model's dtype), made once per step
    #: for every layer (`with_prompt_bias`), as vllm-gaudi's runner makes its `attn_bias`; None: each
    #: call makes it (a `[P, Qp, Kp]` write per layer: 48 us of a 2 x 2k over 6k chunk's 1.75 ms, H100)
    prompt_bias: torch.Tensor | None = field(default=None, kw_only=True)

    def with_prompt_bias(self, dtype: torch.dtype, same_head_dims: bool = True) -> "UnifiedBatch":
        """This batch with `prompt_bias` made for queries of `dtype` (itself when the prompt route has no
        context: that call needs no mask); `same_head_dims` False (MLA's expanded prompts: values narrower
        than keys) makes the one call's full mask, the form those prompts take (`split_context`)."""
        from vllm_gaudi_unified.paths.prompts import prompt_bias

        bias = prompt_bias(self, dtype, same_head_dims)
        return self if bias is None else replace(self, prompt_bias=bias)

    @classmethod
    def from_plan(cls, plan: StepPlan, device: torch.device | str | None = None) -> "UnifiedBatch":
        """The plan's arrays as int64 tensors; an `InvariantPlan` gives an `InvariantBatch` (`from_plans`)."""
        return cls.from_plans((plan,), device)[0][0]

    @classmethod
    def from_plans(cls, plans, device: torch.device | str | None = None, extra=()) -> tuple[tuple, tuple]:
        """(a batch per plan of `plans`, an int64 tensor per host array of `extra`) on `device`, every array in
        one host-to-device copy (`copies.to_device`; on the CPU the tensors are the arrays). An `InvariantPlan`
        gives an `InvariantBatch`; a batch's tensors are its class's plan fields (`_array_fields`), in order."""
        for p in plans:
            if not isinstance(p, StepPlan):
                raise ValueError(f"plans must be StepPlans (plan_step), got {type(p).__name__}")
        for a in extra:
            if not isinstance(a, np.ndarray) or a.dtype.kind not in "iub":
                raise ValueError(f"extra arrays must be numpy integer arrays, got {getattr(a, 'dtype', type(a))}")
        kinds = [InvariantBatch if cls is UnifiedBatch and isinstance(p, InvariantPlan) else cls for p in plans]
        arrays = [getattr(p, n) for p, k in zip(plans, kinds) for n in _array_fields(k)]
        tensors = to_device(arrays + list(extra) if extra else arrays, device)
        batches, at = [], 0
        for p, k in zip(plans, kinds):
            names = _array_fields(k)
            # (trusted: the dataclass __init__ of 14 frozen fields is a tenth of a decode step's host time)
            batches.append(trusted(k, plan=p, **dict(zip(names, tensors[at:at + len(names)]))))
            at += len(names)
        return tuple(batches), tuple(tensors[at:])

    def to(self, device: torch.device | str) -> "UnifiedBatch":
        moved = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("plan", "pieces")}
        moved = {k: None if v is None else v.to(device, non_blocking=True) for k, v in moved.items()}
        return replace(self, pieces=tuple(p.to(device) for p in self.pieces), **moved)

    @property
    def device(self) -> torch.device:
        return self.token_seg_start.device

    # Host-side facts, no device sync.
    bucket = property(lambda self: self.plan.bucket, doc="padded shape (one graph per bucket)")
    shape = property(lambda self: self.plan.shape, doc="the step's own, unpadded shape")
    phase = property(lambda self: self.plan.bucket.phase)
    num_tokens = property(lambda self: self.plan.num_tokens)
    num_requests = property(lambda self: self.plan.num_requests)
    block_size = property(lambda self: self.plan.block_size)
    sliding_window = property(lambda self: self.plan.sliding_window)
    causal_tile = property(lambda self: self.plan.options.causal_tile)
    unique_layout = property(lambda self: self.plan.unique_layout, doc="'slice' or 'gather'")
    max_block_id = property(lambda self: self.plan.max_block_id)
    work_needed = property(lambda self: self.plan.work_needed)
    work_planned = property(lambda self: self.plan.work_planned)


@dataclass(frozen=True, eq=False)
class InvariantBatch(UnifiedBatch):
    """A batch-invariant step (`plan.invariant.InvariantPlan`) on one device: its units and causal columns."""

    dec_rows: torch.Tensor  #: [dec tiles, 1] tile route: the token of each one-row tile
    dec_blocks: torch.Tensor  #: [dec tiles, blocks_per_tile] the chunk's blocks
    dec_lo: torch.Tensor  #: [dec tiles, 1, blocks_per_tile]
    dec_hi: torch.Tensor  #: [dec tiles, 1, blocks_per_tile]
    dec_col: torch.Tensor  #: [dec tiles] chunk index in the request's context
    share_rows: torch.Tensor  #: [share calls, invariant_chunk] tile route: one-token rows of one whole chunk
    share_blocks: torch.Tensor  #: [share calls, blocks_per_tile] that chunk's blocks
    share_col: torch.Tensor  #: [share calls, invariant_chunk] its index in each row's context
    pre_rows: torch.Tensor  #: [pre tiles, invariant_rows] tile route: tokens of one request
    pre_blocks: torch.Tensor  #: [pre tiles, blocks_per_tile]
    pre_lo: torch.Tensor  #: [pre tiles, invariant_rows, blocks_per_tile]
    pre_hi: torch.Tensor  #: [pre tiles, invariant_rows, blocks_per_tile]
    pre_col: torch.Tensor  #: [pre tiles]
    unit_rows: torch.Tensor  #: [unit tiles, unique_tokens] tile route: tokens of one verify step
    unit_blocks: torch.Tensor  #: [unit tiles, blocks_per_tile]
    unit_lo: torch.Tensor  #: [unit tiles, unique_tokens, blocks_per_tile]
    unit_hi: torch.Tensor  #: [unit tiles, unique_tokens, blocks_per_tile]
    unit_col: torch.Tensor  #: [unit tiles]
    causal_col: torch.Tensor  #: [num_causal_tiles] key tile index within its request
    slot_rows: torch.Tensor  #: [slots] fast route: token per (token, block) slot, by token then position
    slot_blocks: torch.Tensor  #: [slots]
    slot_lo: torch.Tensor  #: [slots]
    slot_hi: torch.Tensor  #: [slots]
    slot_starts: torch.Tensor  #: [query_len + 1] token t's slots: `slot_*[slot_starts[t]:slot_starts[t + 1]]`
    slot_take: torch.Tensor  #: [query_len] 1: the token's Triton program takes its request's new keys
    ctx_rows: torch.Tensor  #: [rows] fast route: tokens whose context is one flash segment per request
    ctx_cu_q: torch.Tensor  #: [segments + 1]
    ctx_blocks: torch.Tensor  #: [blocks]
    ctx_cu_k: torch.Tensor  #: [segments + 1]
    ctx_used: torch.Tensor  #: [segments]
    seg_rows: torch.Tensor  #: [rows] fast route: tokens of the requests with several new tokens, not units
    seg_cu: torch.Tensor  #: [segments + 1] fast route: each such request's new tokens, one causal flash segment
    one_rows: torch.Tensor  #: [rows] fast route: tokens of the one-token requests (self pair in their program)
    call_blocks: torch.Tensor  #: [blocks] own calls: each such request's context blocks, in order


class StepBuffers:
    """Memory a server keeps from step to step for its batches' index tensors.

    The planner writes each step into host buffers (`plan.PlanBuffers`), padding
    in place; the batch's tensors are views of one device block that one
    non-blocking copy fills from one host block (page-locked when the device can
    pin), every array cast to int64 at its offset (`copies.KeptCopy`). All are
    sized by the largest bucket (`reserve_for`), so a step allocates nothing, and
    offsets follow the arrays' shapes, so every step of one bucket hands its
    graph the same addresses. On the CPU the
    host buffers are the device tensors (no copy). A batch built into buffers is
    valid until the next build into them (the copy of the previous step is
    waited for before the host block is written again).
    """

    def __init__(self, device: torch.device | str = "cpu", reserve: dict[str, int] | None = None,
                 pin: bool | None = None, copy: bool | None = None):
        """`pin`: page-locked host block (default: off the CPU). `copy`: device tensors apart from the
        host buffers, filled by one copy per step (default: off the CPU; on it, the host buffers are the
        tensors)."""
        self.device = torch.device(device)
        self.on_host = not ((self.device.type != "cpu") if copy is None else copy)
        self.host = PlanBuffers(reserve=reserve)
        pin = (self.device.type != "cpu") if pin is None else pin
        self.blocks = None if self.on_host else KeptCopy(self.device, pin, (reserve or {}).values())

    @staticmethod
    def reserve_for(buckets, options: PlanOptions, block_size: int) -> dict[str, int]:
        """Elements of each array at the largest of `buckets` (field by field)."""
        kb, qt = options.blocks_per_tile(block_size), options.shared_rows
        sizes = {}
        for b in buckets:
            tiles = b.num_shared_blocks // kb
            for name, n in (("token_seg_start", b.query_len), ("causal_q_start", b.num_causal_tiles),
                            ("causal_k_start", b.num_causal_tiles), ("shared_rows", tiles * qt),
                            ("shared_blocks", tiles * kb), ("shared_lo", tiles * qt * kb),
                            ("shared_hi", tiles * qt * kb), ("unique_rows", b.num_unique_blocks),
                            ("unique_blocks", b.num_unique_blocks), ("unique_lo", b.num_unique_blocks),
                            ("unique_hi", b.num_unique_blocks), ("logits_indices", b.num_logits),
                            ("prompt_rows", b.num_prompts * b.prompt_len),
                            ("prompt_blocks", b.num_prompts * b.prompt_blocks), ("prompt_ctx", b.num_prompts),
                            ("prompt_len", b.num_prompts)):
                sizes[name] = max(sizes.get(name, 0), n)
        return sizes

    def wait(self) -> None:
        """Block until the previous step's host -> device copy is done (its host block is free)."""
        if self.blocks is not None:
            self.blocks.wait()

    def batch(self, plan: StepPlan) -> "UnifiedBatch":
        """The plan's arrays as tensors in these buffers: off the host, in one copy (an array not planned in
        the host buffers, as an invariant plan's, is cast into the host block from where it is); on it, the
        host buffers (such an array is copied in; an empty array: an empty tensor)."""
        cls = InvariantBatch if isinstance(plan, InvariantPlan) else UnifiedBatch
        names = _array_fields(cls)
        arrays = [getattr(plan, name) for name in names]
        if self.blocks is not None:
            return trusted(cls, plan=plan, **dict(zip(names, self.blocks(arrays))))
        values = {}
        for name, a in zip(names, arrays):
            if a is not None and not a.size:
                a = np.empty(a.shape, np.int64)
            elif a is not None and not self.host.holds(name, a):  # not planned here (an invariant plan)
                a = self.host.keep(name, np.ascontiguousarray(a, dtype=np.int64))
            values[name] = None if a is None else torch.from_numpy(a)
        return trusted(cls, plan=plan, **values)


_FIELDS: dict = {}


def _array_fields(cls) -> tuple[str, ...]:
    """The tensor fields of a batch class that come from its plan (all but `plan`, `pieces` and the derived
    `prompt_bias`), listed once."""
    names = _FIELDS.get(cls)
    if names is None:
        names = _FIELDS[cls] = tuple(f.name for f in fields(cls) if f.name not in ("plan", "pieces", "prompt_bias"))
    return names


def build_unified_batch(query_lens, context_lens, block_table, block_size: int, *,
                        sliding_window: int | None = None, num_blocks: int | None = None,
                        options: PlanOptions | None = None, bucket=None,
                        device: torch.device | str | None = None,
                        buffers: StepBuffers | None = None, causal: bool = True) -> UnifiedBatch:
    """Plan one scheduler step and put it on `device`.

    query_lens [R] (>= 1), context_lens [R] (>= 0), block_table [R, M]: the
    scheduler's view of the step (see `plan/default.py` for the semantics).
    `bucket`: a `Bucket` to pad to, or a bucket plan (anything with
    `.find(shape) -> Bucket | None`; None runs the step unpadded, and the plan's
    miss policy decides whether a miss raises).
    `num_blocks`: the KV cache size; when given, block ids are checked here.
    `buffers`: `StepBuffers` to plan and pad into (a server's steps; `device` is theirs): the batch
    is valid until the next build into them.
    `causal=False`: an encoder-only step, every token sees its whole request (no cache; `plan_step`).
    """
    if not (bucket is None or isinstance(bucket, Bucket)
            or (callable(getattr(bucket, "find", None)) and not isinstance(bucket, (str, bytes)))):
        raise ValueError(f"bucket must be a Bucket, a bucket plan (with .find) or None, got {bucket!r}")
    if not isinstance(causal, (bool, np.bool_)):
        raise ValueError(f"causal must be a bool, got {causal!r}")
    if device is not None:
        device = check_device(device)
    if buffers is not None:
        if not isinstance(buffers, StepBuffers):
            raise ValueError(f"buffers must be StepBuffers or None, got {type(buffers).__name__}")
        if device is not None and device != buffers.device:
            raise ValueError(f"device {device} differs from the buffers' device {buffers.device}")
    host = None if buffers is None else buffers.host
    plan_with = functools.partial(plan_step, query_lens, context_lens, block_table, block_size,
                                  sliding_window=sliding_window, num_blocks=num_blocks, causal=causal)
    plan = plan_with(options=options, buffers=host)
    if plan.shape.num_prompts:
        tiles = on_route(options or DEFAULT_OPTIONS, "tiles")
        probe = []  # the tiled plan when the route choice asks for it, in arrays of its own (`host` holds `plan`)

        def tiled_shape() -> Bucket:
            probe.append(plan_with(options=tiles))
            return probe[0].shape

        if not _keeps_prompt_route(bucket, plan.shape, tiled_shape):
            plan = probe[0] if probe and host is None else plan_with(options=tiles, buffers=host)
    cap = getattr(bucket, "gather_cap", None)
    if cap is not None and cap.exceeded(plan.shape):  # rare: several calls, each padded into new arrays
        pieces = [_pad_to(p, bucket) for p in split_plan(plan, cap)]
        device = buffers.device if buffers is not None else device
        first, *rest = UnifiedBatch.from_plans(pieces, device)[0]  # (every piece in one copy)
        return replace(first, pieces=tuple(rest))
    if bucket is not None:
        plan = _pad_to(plan, bucket, host)
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug("step %s bucket %s unique=%s work needed=%s planned=%s", plan.shape, plan.bucket,
                     plan.unique_layout, plan.work_needed, plan.work_planned)
    return UnifiedBatch.from_plan(plan, device) if buffers is None else buffers.batch(plan)


def check_device(device, name: str = "device") -> torch.device:
    """`device` (a torch.device, a string such as 'cuda:1', an index) as a torch.device this machine has,
    or a ValueError naming `name` (the argument or the flag), before any work."""
    try:
        checked = torch.device(device)
    except (RuntimeError, ValueError, TypeError):
        raise ValueError(f"{name} {device!r} is not a torch device (cpu, cuda, cuda:N, hpu)") from None
    return checked if checked.type == "cpu" else _on_this_machine(checked, name)


@functools.lru_cache(maxsize=16)
def _on_this_machine(checked: torch.device, name: str) -> torch.device:
    """`checked` when this machine has it (found once per device: a server names its device every step)."""
    if checked.type == "hpu":
        from vllm_gaudi_unified.hpu import habana_importable

        if habana_importable():  # pragma: no cover - needs Gaudi
            import habana_frameworks.torch  # noqa: F401
        count = torch.hpu.device_count() if hasattr(torch, "hpu") and torch.hpu.is_available() else 0
    elif checked.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    else:
        raise ValueError(f"{name} {checked}: the package runs on cpu, cuda or hpu")
    if count == 0:
        raise ValueError(f"{name} {checked}: this machine has no {checked.type} device")
    if checked.index is not None and checked.index >= count:
        raise ValueError(f"{name} {checked}: this machine has {count} {checked.type} device(s), 0 to {count - 1}")
    return checked


def prompt_graph_for(bucket, shape: Bucket) -> bool:
    """Whether a step of `shape` (with prompts) may run on the prompt route at `bucket`: always with no
    bucket; with a `Bucket`, when it has a prompt grid (`num_prompts > 0`; the five sizes alone describe
    the tiled route); with a bucket plan, only when one of its prompt graphs covers it
    (`bucket_plans/prompt_graphs.py`); any other `.find` object takes every shape."""
    if isinstance(bucket, Bucket):
        return bucket.num_prompts > 0
    prompt_graph = getattr(bucket, "prompt_graph", None)
    return prompt_graph is None or prompt_graph(shape) is not None


def _keeps_prompt_route(bucket, shape: Bucket, tiled_shape) -> bool:
    """Whether a step planned on the prompt route (`shape`) stays on it at `bucket`: `prompt_graph_for`, and
    with a bucket plan that weighs routes (`BucketPlan.route`), only when its prompt graph is the cheaper graph."""
    route = getattr(bucket, "route", None)
    if route is None or isinstance(bucket, Bucket):
        return prompt_graph_for(bucket, shape)
    return route(shape, tiled_shape) == "dense"


def _pad_to(plan: StepPlan, bucket, host: PlanBuffers | None = None) -> StepPlan:
    target = bucket if isinstance(bucket, Bucket) else bucket.find(plan.shape)
    if target is not None and not isinstance(bucket, Bucket):  # any plan's `find`: the step's prompt shape
        target = with_prompts(target, plan.shape)
    return plan if target is None else pad_plan(plan, target, host)


__all__ = ["InvariantBatch", "StepBuffers", "UnifiedBatch", "build_unified_batch", "check_device", "PathWork"]
