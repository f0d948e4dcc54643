"""The bucket plan: the set of compiled shapes, and `find`, which runs every step.

`find(shape)` returns the cheapest bucket (by the plan's work model) whose every
size is at least the step's, of the step's own phase where one covers it: a
step without causal tiles (a decode step, `-su` or `--u`) never pays for a path
it does not have, however cheap the model thinks a bucket with that path is
(bucket plans learned by `tools/robust.py` hold a chain of buckets for each
phase up to the settings' limits, so one always covers). Only a phase the plan
has no covering bucket for falls back to the cheapest covering bucket of any
phase. It runs each step, so it is a few bit operations:
buckets are numbered by cost, and for each dimension and each distinct bucket
value the plan keeps a bit mask (a Python int) of the buckets at least that
large, and one mask per phase. A step's value is located by `bisect` in each dimension, the five masks
are ANDed (then with its phase's, unless that leaves none), and the lowest set bit is the cheapest covering bucket.

A step that no bucket covers is a *miss*, handled by the plan's miss policy,
never silently:

- `error` (default): raise `BucketMiss` naming the dimension and value;
- `largest`: pad to the largest bucket when it covers the step (else raise);
- `unbucketed`: return None, so the step runs at its own shape (on Gaudi: a
  graph compiled while serving); a warning is logged for the first misses.
"""
from __future__ import annotations

import json
import os
from bisect import bisect_left
from dataclasses import dataclass, field, replace

import numpy as np

from vllm_gaudi_unified.bucket import PHASES, PROMPT_FIELDS, Bucket, bucket_from_sizes, codes_of, with_prompts
from vllm_gaudi_unified.bucket_plans.cost import DIMS, CostModel, Hardware, ModelSpec
from vllm_gaudi_unified.bucket_plans.prompt_graphs import PromptGraphs
from vllm_gaudi_unified.plan.options import on_route
from vllm_gaudi_unified.bucket_plans.settings import ServerSettings
from vllm_gaudi_unified.files import atomic_write
from vllm_gaudi_unified.log import get_logger
from vllm_gaudi_unified.plan.split import GatherCap, piece_sizes

logger = get_logger(__name__)

MISS_POLICIES = ("error", "largest", "unbucketed")
FORMAT = "vllm-gaudi-unified/bucket-plan"
VERSION = 1


#: Share of device memory one call's gathered K and V (one layer) may take, unless told otherwise.
DEFAULT_MEMORY_SHARE = 0.04


def gather_cap_for(settings: ServerSettings, model: ModelSpec, hardware: Hardware,
                   share: float = DEFAULT_MEMORY_SHARE) -> GatherCap:
    """The cap that keeps one call's gathered K and V of one layer within `share` of the device's memory."""
    return GatherCap.from_memory(hardware.memory_gb * 1e9, share, settings.block_size, model.num_kv_heads,
                                 model.head_dim, model.dtype_bytes, settings.blocks_per_tile)


class BucketMiss(ValueError):
    """No bucket of the plan covers a step (and the miss policy says to raise)."""


@dataclass
class BucketPlan:
    """A set of buckets plus the settings, planner options and work model it was made for."""

    buckets: list[Bucket]
    settings: ServerSettings
    model: ModelSpec = field(default_factory=ModelSpec)
    hardware: Hardware = field(default_factory=Hardware)
    strategy: str = ""
    miss_policy: str = "error"
    info: dict = field(default_factory=dict)  #: how it was made (command, traces, expected waste)
    #: most block slots one call may gather (a share of device memory); a step beyond it is split by the
    #: planner into pieces within it (`plan/split.py`), so no bucket needs to be larger
    gather_cap: GatherCap = field(default_factory=GatherCap)
    #: buckets with a prompt shape, in which steps run on the prompt route (`prompt_graphs.py`); a step
    #: with prompts none of them covers is planned on the tiled route
    prompt_graphs: list[Bucket] = field(default_factory=list)

    def __post_init__(self):
        if self.miss_policy not in MISS_POLICIES:
            raise ValueError(f"miss_policy must be one of {MISS_POLICIES}, got {self.miss_policy!r}")
        if not self.buckets:
            raise ValueError("a bucket plan needs at least one bucket")
        # Shared slots come in whole tiles (a batch-invariant plan counts units of one block instead).
        kb = 1 if self.settings.options.batch_invariant else self.settings.blocks_per_tile
        for b in self.buckets:
            if not isinstance(b, Bucket):
                raise ValueError(f"not a Bucket: {b!r}")
            if b.num_shared_blocks % kb:
                raise ValueError(f"bucket {b}: num_shared_blocks must be a multiple of the {kb} blocks of a "
                                 f"shared tile")
            if self.gather_cap.exceeded(b):
                raise ValueError(f"bucket {b} gathers more block slots than the plan's cap {self.gather_cap}")
        self._index()
        for g in self.prompt_graphs:
            if not isinstance(g, Bucket) or g.num_shared_blocks % kb or self.gather_cap.exceeded(g):
                raise ValueError(f"prompt graph {g}: not a Bucket, or its shared slots are not whole tiles of {kb} "
                                 f"blocks, or it gathers more than the plan's cap {self.gather_cap}")
        model = self.cost_model
        self._graph_costs = {g: model.graph_cost(g, self._weights) for g in set(self.prompt_graphs)}
        self._prompts = PromptGraphs(self.prompt_graphs, self.settings.block_size, self._graph_costs.__getitem__)
        self.prompt_graphs = self._prompts.buckets

    @property
    def step_options(self):
        """The planner options a server plans its steps with: on the prompt route when the plan has prompt
        graphs (steps none covers are planned again on the tiled route, `settings.options`)."""
        return on_route(self.settings.options, "dense") if self.prompt_graphs else self.settings.options

    def options_for(self, bucket: Bucket):
        """The options a step of `bucket` is planned with (warmup plans the smallest step of each)."""
        return on_route(self.settings.options, "dense") if bucket.num_prompts else self.settings.options

    def prompt_graph(self, shape: Bucket) -> Bucket | None:
        """The cheapest prompt graph (`CostModel.graph_cost`) covering a step with prompts, or None: plan it on
        the tiled route."""
        return self._prompts.find(shape)

    def graph_cost(self, graph: Bucket) -> float:
        """`CostModel.graph_cost` of one of the plan's prompt graphs (priced once, when the plan is made)."""
        return self._graph_costs[graph]

    def route(self, shape: Bucket, tiled_shape) -> str:
        """The route of a step with prompts (`shape`: planned on the prompt route): 'dense' when a prompt graph
        covers it and costs, in the plan's time model (`CostModel.graph_cost`), no more than the bucket its
        tiled plan pads to (both priced as the device runs them: `cost.MEASURED_FACTORS`); else 'tiles'. A
        short question over a long document may have only a large prompt graph covering it, where a tiled
        bucket is far cheaper. `tiled_shape()` gives the tiled plan's shape; it is asked for only when the
        cheapest bucket with the step's query tokens and logits (the same on both routes) costs less than the
        graph, so most steps are planned once."""
        graph = self.prompt_graph(shape)
        if graph is None:
            return "tiles"
        cost = self.graph_cost(graph)
        if cost <= self.tiled_floor(shape.query_len, shape.num_logits):
            return "dense"
        tiled = tiled_shape()
        i = self.covering(tiled)
        return "dense" if i < 0 or cost <= float(self.costs[i]) else "tiles"

    def tiled_floor(self, q: int, l: int, c: int = 0) -> float:
        """The least cost of a bucket with at least `q` query tokens, `l` logits and `c` causal tiles (inf: none)."""
        m = -1
        for d, x in ((0, q), (3, l), (4, c)):
            i = bisect_left(self._values[d], x)
            m &= self._masks[d][i] if i < len(self._values[d]) else 0
        return float(self.costs[(m & -m).bit_length() - 1]) if m else float("inf")

    def fewest_rows(self, num_tokens: int) -> int:
        """The fewest query rows of a bucket that hold `num_tokens` tokens, else `num_tokens` (from the plan's
        own index of bucket sizes)."""
        rows = self._values[0]  # the buckets' query lengths, sorted, each once
        i = bisect_left(rows, num_tokens)
        return rows[i] if i < len(rows) else int(num_tokens)

    # ---- lookup -----------------------------------------------------------------------------
    @property
    def cost_model(self) -> CostModel:
        return CostModel(self.model, self.hardware, self.settings.block_size, self.settings.options)

    def _index(self) -> None:
        unique = sorted(set(self.buckets))
        sizes = np.array([b.sizes for b in unique], dtype=np.int64).reshape(-1, len(DIMS))
        self._weights = self.cost_model.weights
        cost = sizes @ self._weights
        order = np.lexsort(tuple(sizes[:, ::-1].T) + (cost,))  # by cost, then by sizes
        self.buckets = [unique[i] for i in order]
        self.sizes = sizes[order]
        self.costs = cost[order]
        self._values: list[list[int]] = []
        self._masks: list[list[int]] = []
        for d in range(len(DIMS)):
            col = self.sizes[:, d]
            values = sorted(set(int(v) for v in col))
            masks = []
            for v in values:
                bits = np.flatnonzero(col >= v)
                m = 0
                for i in bits.tolist():
                    m |= 1 << i
                masks.append(m)
            self._values.append(values)
            self._masks.append(masks)
        codes = codes_of(self.sizes)
        self._phase_masks = [sum(1 << int(i) for i in np.flatnonzero(codes == c)) for c in range(len(PHASES))]
        self._largest = self.buckets[int(np.argmax(self.costs))]
        self._misses_logged = 0

    def __len__(self) -> int:
        return len(self.buckets)

    def covering(self, shape) -> int:
        """Index of the cheapest bucket that covers a step's tiled `shape` and that the gather cap allows;
        -1 if none."""
        return -1 if self.gather_cap.exceeded(shape) else self.find_sizes(*shape.sizes)

    def find_sizes(self, q: int, s: int, u: int, l: int, c: int) -> int:
        """Index (into `buckets`) of the cheapest bucket covering these sizes, of their phase where one
        covers them; -1 if none."""
        vals, masks = self._values, self._masks
        i = bisect_left(vals[0], q)
        if i == len(vals[0]):
            return -1
        m = masks[0][i]
        for d, x in ((1, s), (2, u), (3, l), (4, c)):
            i = bisect_left(vals[d], x)
            if i == len(vals[d]):
                return -1
            m &= masks[d][i]
        if not m:
            return -1
        own = m & self._phase_masks[(4 if c > 0 else 0) | (2 if s > 0 else 0) | (1 if u > 0 else 0)]
        m = own or m
        return (m & -m).bit_length() - 1

    def find(self, shape: Bucket) -> Bucket | None:
        """The cheapest bucket covering `shape`; on a miss, what the miss policy says. The plan's buckets
        count the five sizes; the prompt route's shape comes from the step, in powers of two
        (`bucket.with_prompts`)."""
        if shape.num_prompts and self.prompt_graphs:
            graph = self.prompt_graph(shape)
            if graph is not None:
                return graph
        i = self.find_sizes(shape.query_len, shape.num_shared_blocks, shape.num_unique_blocks, shape.num_logits,
                            shape.num_causal_tiles)
        if i >= 0:
            return with_prompts(self.buckets[i], shape)
        return self._miss(shape)

    def find_all(self, sizes: np.ndarray) -> np.ndarray:
        """Bucket index per shape [N, 5] (-1 = miss, whatever the policy), as `find_sizes` picks it; vectorised
        over steps."""
        sizes = np.asarray(sizes, dtype=np.int64).reshape(-1, len(DIMS))
        best = np.full(len(sizes), -1, np.int64)
        codes, bucket_codes = codes_of(sizes), codes_of(self.sizes)
        # Buckets are sorted by cost: the first covering one wins. Chunked to bound memory.
        for start in range(0, len(sizes), 4096):
            part = sizes[start:start + 4096]
            cover = np.ones((len(part), len(self.buckets)), bool)
            for d in range(len(DIMS)):
                cover &= self.sizes[None, :, d] >= part[:, None, d]
            hit = cover.any(1)
            own = cover & (bucket_codes[None, :] == codes[start:start + len(part), None])
            cover = np.where(own.any(1, keepdims=True), own, cover)
            best[start:start + len(part)] = np.where(hit, cover.argmax(1), -1)
        return best

    def _miss(self, shape: Bucket) -> Bucket | None:
        largest = with_prompts(self._largest, shape)
        if self.miss_policy == "largest" and largest.covers(shape):
            return largest
        if self.miss_policy == "unbucketed":
            if self._misses_logged < 10:
                self._misses_logged += 1
                logger.warning("no bucket covers step %s (%s); running it unbucketed (a new graph)", shape,
                               self.explain_miss(shape))
            return None
        raise BucketMiss(f"no bucket of the plan covers step {shape}: {self.explain_miss(shape)} "
                         f"(miss policy {self.miss_policy!r})")

    def explain_miss(self, shape: Bucket) -> str:
        """Which dimension(s) are beyond the plan, with the values."""
        step = shape.sizes
        top = self.sizes.max(0)
        over = [f"{DIMS[d]} = {step[d]} > {int(top[d])} (the plan's largest)" for d in range(len(DIMS))
                if step[d] > top[d]]
        if over:
            return "; ".join(over)
        # Every dimension fits some bucket, but no bucket fits all: name the dimensions that
        # rule out the bucket closest in cost among those covering the most dimensions.
        fits = self.sizes >= np.asarray(step)[None, :]
        best = int(np.argmax(fits.sum(1) * 1e18 - self.costs))
        bad = [f"{DIMS[d]} = {step[d]} > {int(self.sizes[best, d])}" for d in range(len(DIMS)) if not fits[best, d]]
        return f"nearest bucket {self.buckets[best]} is too small in " + ", ".join(bad)

    # ---- checks -----------------------------------------------------------------------------
    def check_compatible(self, block_size: int, options=None, max_num_seqs: int | None = None,
                         max_num_batched_tokens: int | None = None) -> None:
        """Raise if the plan was made for other settings than the server's."""
        s = self.settings
        problems = []
        if block_size != s.block_size:
            problems.append(f"block_size {block_size} != plan's {s.block_size}")
        if options is not None and options != s.options:
            problems.append(f"planner options {options} != plan's {s.options}")
        if max_num_seqs is not None and max_num_seqs > s.max_num_seqs:
            problems.append(f"max_num_seqs {max_num_seqs} > plan's {s.max_num_seqs}")
        if max_num_batched_tokens is not None and max_num_batched_tokens > s.max_num_batched_tokens:
            problems.append(f"max_num_batched_tokens {max_num_batched_tokens} > plan's {s.max_num_batched_tokens}")
        if problems:
            raise ValueError("bucket plan does not match the server: " + "; ".join(problems))

    def covers_limits(self) -> bool:
        """True when the largest shape the settings allow (`ServerSettings.limits`, of the plan's mode) has
        buckets: every piece the gather cap cuts it into; a batch-invariant step is never cut, so itself."""
        lim = self.settings.limits()[None, :]
        pieces = lim if self.settings.options.batch_invariant else piece_sizes(
            lim, self.gather_cap, self.settings.blocks_per_tile)[0]
        return all(self.find_sizes(*(int(x) for x in p)) >= 0 for p in pieces)

    # ---- files ------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {
            "format": FORMAT, "version": VERSION, "strategy": self.strategy, "miss_policy": self.miss_policy,
            "settings": self.settings.to_dict(), "model": vars(self.model).copy(), "hardware": vars(self.hardware).copy(),
            "fields": ["phase", *DIMS], "info": self.info, "gather_cap": vars(self.gather_cap).copy(),
            "prompt_fields": ["phase", *DIMS, *PROMPT_FIELDS],
            "prompt_graphs": [[b.phase, *b.sizes, *b.prompts] for b in self.prompt_graphs],
            "buckets": [[b.phase, *b.sizes] for b in self.buckets],
        }

    @classmethod
    def from_dict(cls, d: dict, source: str = "plan") -> "BucketPlan":
        """A plan from its JSON form; any problem is a ValueError naming `source` and the key."""
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            found = d.get("format") if isinstance(d, dict) else f"a JSON {type(d).__name__}"
            raise ValueError(f"{source}: not a bucket plan (format {found!r}, expected {FORMAT!r})")
        if d.get("version") != VERSION:
            raise ValueError(f"{source}: bucket plan version {d.get('version')!r} is not supported ({VERSION})")
        for key in ("settings", "buckets"):
            if key not in d:
                raise ValueError(f"{source}: not a bucket plan: no {key!r}")
        order = d.get("fields", ["phase", *DIMS])
        if not (isinstance(order, list) and sorted(map(str, order)) == sorted(["phase", *DIMS])):
            raise ValueError(f"{source}: fields must name phase and {', '.join(DIMS)}, got {order!r}")
        idx = [order.index(f) for f in DIMS]
        if not isinstance(d["buckets"], list):
            raise ValueError(f"{source}: buckets must be a list of rows")
        buckets = [_bucket_row(row, order, idx, f"{source}: buckets[{i}]") for i, row in enumerate(d["buckets"])]
        graphs = d.get("prompt_graphs", [])
        if not isinstance(graphs, list) or d.get("prompt_fields", ["phase", *DIMS, *PROMPT_FIELDS]) != [
                "phase", *DIMS, *PROMPT_FIELDS]:
            raise ValueError(f"{source}: prompt_graphs must be a list of rows of {['phase', *DIMS, *PROMPT_FIELDS]}")
        graphs = [_bucket_row(row, ["phase", *DIMS, *PROMPT_FIELDS], list(range(1, 9)), f"{source}: prompt_graphs[{i}]")
                  for i, row in enumerate(graphs)]
        settings = _section(source, "settings", lambda: ServerSettings.from_dict(d["settings"]))
        model = _section(source, "model", lambda: ModelSpec(**d.get("model", {})))
        hardware = _section(source, "hardware", lambda: Hardware(**d.get("hardware", {})))
        gather_cap = _section(source, "gather_cap", lambda: GatherCap(**d.get("gather_cap", {})))
        return _section(source, "plan", lambda: cls(
            buckets=buckets, settings=settings, model=model, hardware=hardware, strategy=d.get("strategy", ""),
            miss_policy=d.get("miss_policy", "error"), info=d.get("info", {}), gather_cap=gather_cap,
            prompt_graphs=graphs))

    def save(self, path: str) -> None:
        if os.path.dirname(path):
            os.makedirs(os.path.dirname(path), exist_ok=True)
        d = self.to_dict()
        rows = ",\n    ".join(json.dumps(r) for r in d.pop("buckets"))
        text = json.dumps(d, indent=2)
        text = text[:-2] + f',\n  "buckets": [\n    {rows}\n  ]\n}}\n'  # one bucket a line: readable diffs
        with atomic_write(path) as f:  # whole or not at all (files.py)
            f.write(text)

    @classmethod
    def load(cls, path: str, miss_policy: str | None = None) -> "BucketPlan":
        try:
            with open(path, encoding="utf-8") as f:
                d = json.load(f)
        except FileNotFoundError:
            raise FileNotFoundError(f"{path}: no such bucket plan") from None
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
        except UnicodeDecodeError as exc:
            raise ValueError(f"{path}: not a bucket plan (not UTF-8 text: {exc.reason})") from None
        if miss_policy is not None:
            d["miss_policy"] = miss_policy
        return cls.from_dict(d, path)


#: Largest size a bucket row may hold (far above any real step; an int64 with room to spare).
MAX_BUCKET_SIZE = 1 << 40


def _bucket_row(row, order: list, idx: list, where: str) -> Bucket:
    if not (isinstance(row, list) and len(row) == len(order)):
        raise ValueError(f"{where}: a bucket is a list of {len(order)} values ({', '.join(order)}), got {row!r}")
    sizes = [row[i] for i in idx]
    for name, v in zip(DIMS + PROMPT_FIELDS, sizes):
        if type(v) is not int or not 0 <= v <= MAX_BUCKET_SIZE:
            raise ValueError(f"{where}: {name} must be an integer in [0, {MAX_BUCKET_SIZE}], got {v!r}")
    b = bucket_from_sizes(sizes[:5])
    if len(sizes) > 5:
        b = replace(b, **dict(zip(PROMPT_FIELDS, sizes[5:])))
        if not (b.num_prompts and b.prompt_len):
            raise ValueError(f"{where}: a prompt graph needs num_prompts > 0 and prompt_len > 0, got {row!r}")
    if b.phase != row[order.index("phase")]:
        raise ValueError(f"{where}: bucket {row} has a phase that disagrees with its sizes")
    return b


def _section(source: str, name: str, make):
    """`make()`, its errors (unknown keys, bad values) as one ValueError naming the file and the section."""
    try:
        return make()
    except (TypeError, ValueError, KeyError, AttributeError) as exc:
        raise ValueError(f"{source}: {name}: {' '.join(str(exc).split())}") from None
