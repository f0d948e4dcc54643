"""A workload simulator that schedules like vLLM's v1 scheduler, for making traces.

What it models, and where vLLM does the same (vllm/v1/core/sched/scheduler.py,
vllm/v1/core/kv_cache_manager.py, vllm/v1/core/block_pool.py), written from
their logic, not their code:

1. A step has a token budget `max_num_batched_tokens`. Running requests go
   first, in order: each gets all its remaining tokens (1 for a decode, the rest
   of its prompt for a chunked prefill) or what is left of the budget.
2. When a running request needs a block and none is free, the *last* running
   request is preempted (recompute): its blocks are freed, its progress is
   reset, and it goes back to the front of the waiting queue.
3. If nothing was preempted, waiting requests are admitted in arrival order while
   budget remains and fewer than `max_num_seqs` run. A new request first looks
   its prompt up in the prefix cache (hashes of full blocks, chained on the
   previous block's hash; at most `num_tokens - 1` tokens may hit, so at least
   one token is computed), then takes `min(remaining, budget)` tokens
   (chunked prefill). If its blocks cannot be allocated, admission stops.
4. Block ids come from a free list in LRU order: block 0 is the null block;
   a freed block goes to the tail (a request's blocks are freed tail first so
   that prefixes stay cached longest), allocation takes the head and evicts
   the cached hash it held; a cache hit on a free block takes it out of the
   list. So, as in a long-running server, ids spread over the whole cache.
5. Full blocks are registered in the prefix cache when they are allocated for a
   step (vLLM does this at scheduling time; the KV write of the same forward
   pass precedes attention, so a request admitted later in the same step may
   already hit them: this is how `n > 1` children share the prompt).
6. After a step, every request whose tokens are all computed samples one token;
   it finishes at its output length or at `max_model_len`, and its blocks are freed.
7. Speculative decoding (`num_speculative_tokens = k > 0`, vLLM's
   scheduler with `scheduled_spec_decode_tokens`): a decode (a request with
   an output token already) is scheduled with its `k` drafts, `1 + k` tokens
   (fewer at `max_model_len` or at the end of the budget); after the step the
   drafts are accepted one after the other with probability
   `draft_acceptance` until the first rejection, so the request gains `1 + a`
   tokens; the rejected drafts' positions are computed again next step (their
   blocks stay allocated, as in vLLM).

The workload (`workloads.py`): requests arrive by a Poisson process (`arrival_rate` per step, or
all at once when 0), prompt and output lengths are log-normal, a share of prompts
starts with one of a few common prefixes (system prompts), a share are follow-up
turns resending an earlier conversation (its prompt and output) plus a new
message, and a share are sampled with `n > 1` (as in vLLM v1: n child requests
with the same prompt, different outputs). Everything follows from one seed.
"""
from __future__ import annotations

import math
from collections import OrderedDict, deque
from dataclasses import asdict, dataclass
from typing import Callable, Iterator

import numpy as np

from vllm_gaudi_unified.bucket_plans.settings import check_settings
from vllm_gaudi_unified.bucket_plans.trace import TraceStep
from vllm_gaudi_unified.bucket_plans.workloads import WorkloadConfig


@dataclass(frozen=True)
class SchedulerConfig:
    """The server settings that shape the steps."""

    block_size: int = 128
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 8192
    num_blocks: int = 6000  #: KV cache blocks, null block included
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    num_speculative_tokens: int = 0  #: drafts per decode (7. in the module docstring)
    draft_acceptance: float = 0.7  #: probability that a draft is accepted, given the earlier ones were

    @classmethod
    def from_settings(cls, settings, **flags) -> "SchedulerConfig":
        """The scheduler of a server with these `ServerSettings` (flags: prefix caching, chunked prefill,
        draft acceptance)."""
        return cls(settings.block_size, settings.max_num_seqs, settings.max_num_batched_tokens,
                   settings.max_model_len, settings.num_blocks,
                   num_speculative_tokens=settings.num_speculative_tokens, **flags)

    def __post_init__(self):
        check_settings(self.block_size, self.max_num_seqs, self.max_num_batched_tokens, self.max_model_len,
                       self.num_blocks)
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 0:
            raise ValueError(f"num_speculative_tokens must be an integer >= 0, got {k!r}")
        if not 0.0 <= self.draft_acceptance <= 1.0:
            raise ValueError(f"draft_acceptance must be in [0, 1], got {self.draft_acceptance!r}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError("without chunked prefill max_num_batched_tokens must be >= max_model_len "
                             f"({self.max_num_batched_tokens} < {self.max_model_len})")


class _Request:
    __slots__ = ("rid", "tokens", "prompt_len", "max_tokens", "num_tokens", "num_computed", "blocks",
                 "hashes", "num_cached", "arrival")

    def __init__(self, rid: int, tokens: np.ndarray, prompt_len: int, max_tokens: int, arrival: int):
        self.rid = rid
        self.tokens = tokens  # prompt + every output token it will produce
        self.prompt_len = prompt_len
        self.max_tokens = max_tokens
        self.num_tokens = prompt_len  # prompt + outputs sampled so far
        self.num_computed = 0
        self.blocks: list[int] = []
        self.hashes: list[int] = []  # chained hashes of full blocks of `tokens`, computed lazily
        self.num_cached = 0  # leading blocks already registered in the prefix cache
        self.arrival = arrival

    def block_hash(self, i: int, block_size: int) -> int:
        while len(self.hashes) <= i:
            j = len(self.hashes)
            parent = self.hashes[-1] if self.hashes else 0
            self.hashes.append(hash((parent, self.tokens[j * block_size:(j + 1) * block_size].tobytes())))
        return self.hashes[i]


class BlockPool:
    """Physical KV blocks: a free list in LRU order plus the prefix-cache map."""

    def __init__(self, num_blocks: int):
        self.ref = np.zeros(num_blocks, dtype=np.int64)
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(1, num_blocks))  # 0 = null
        self.cached: dict[int, int] = {}  # hash -> block
        self.block_hash: dict[int, int] = {}  # block -> hash

    @property
    def num_free(self) -> int:
        return len(self.free)

    def lookup(self, hashes: list[int]) -> list[int]:
        hit = []
        for h in hashes:
            b = self.cached.get(h)
            if b is None:
                break
            hit.append(b)
        return hit

    def touch(self, blocks: list[int]) -> None:
        for b in blocks:
            if self.ref[b] == 0:
                del self.free[b]
            self.ref[b] += 1

    def take(self, n: int) -> list[int]:
        out = []
        for _ in range(n):
            b, _ = self.free.popitem(last=False)
            h = self.block_hash.pop(b, None)
            if h is not None and self.cached.get(h) == b:
                del self.cached[h]
            self.ref[b] = 1
            out.append(b)
        return out

    def release(self, blocks: list[int]) -> None:
        for b in reversed(blocks):  # tail first: prefixes are evicted last
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.free[b] = None

    def register(self, block: int, h: int) -> None:
        if h not in self.cached and block not in self.block_hash:
            self.cached[h] = block
            self.block_hash[block] = h


class Simulator:
    """Steps a v1-like scheduler over a generated workload; iterate it for TraceSteps."""

    def __init__(self, sched: SchedulerConfig, workload: WorkloadConfig, seed: int = 0):
        self.sched = sched
        self.work = workload
        self.seed = seed
        self.rng = np.random.default_rng(seed)
        self.pool = BlockPool(sched.num_blocks)
        self.waiting: deque[_Request] = deque()
        self.running: list[_Request] = []
        self.finished: list[_Request] = []
        self.num_preemptions = 0
        self.step_index = 0
        self._arrivals = self._make_arrivals()
        self._next_rid = 0
        self._idle: list[_Request] = []
        self._children: set[int] = set()  # finished conversations a follow-up may continue
        self._prefix_tokens = [np.random.default_rng([seed, 7, i]).integers(1 << 20, 1 << 30, n)
                               for i, n in enumerate(workload.prefix_lens)]
        self._drafts_rng = np.random.default_rng([seed, 11])  # its own stream: the workload stays the same

    # ---- workload -------------------------------------------------------------------------
    def _make_arrivals(self) -> np.ndarray:
        n = self.work.num_requests
        if self.work.arrival_rate <= 0:
            return np.zeros(n, dtype=np.int64)
        gaps = self.rng.exponential(1.0 / self.work.arrival_rate, n)
        return np.floor(np.cumsum(gaps) - gaps[0]).astype(np.int64)

    def _lognormal(self, median: float, sigma: float, lo: int, hi: int) -> int:
        return int(np.clip(round(math.exp(math.log(median) + sigma * self.rng.standard_normal())), lo, hi))

    def _new_tokens(self, n: int) -> np.ndarray:
        return self.rng.integers(1 << 30, 1 << 62, n)

    def _spawn(self, arrival: int) -> list[_Request]:
        w, limit = self.work, self.sched.max_model_len
        prompt = None
        if self._idle and self.rng.random() < w.followup_share:
            # A follow-up resends a finished conversation (its prompt and the output it got),
            # which then goes on as this request: each conversation is continued once.
            parent = self._idle.pop(int(self.rng.integers(len(self._idle))))
            earlier = parent.tokens[: parent.prompt_len + parent.max_tokens]
            message = self._new_tokens(self._lognormal(w.prompt_median, w.prompt_sigma, 1, w.prompt_max))
            prompt = np.concatenate([earlier, message])
            if len(prompt) >= limit - 1:
                prompt = None  # would not fit: a fresh conversation instead
        if prompt is None:
            body = self._new_tokens(self._lognormal(w.prompt_median, w.prompt_sigma, 1, w.prompt_max))
            if w.prefix_lens and self.rng.random() < w.prefix_share:
                prefix = self._prefix_tokens[int(self.rng.integers(len(self._prefix_tokens)))]
                body = np.concatenate([prefix, body])
            prompt = body[: limit - 1]
        n = w.parallel_n if self.rng.random() < w.parallel_share else 1
        out = []
        for k in range(n):
            if k:
                self._children.add(self._next_rid)  # n > 1: only the first child can be continued
            max_tokens = min(self._lognormal(w.output_median, w.output_sigma, 1, w.output_max), limit - len(prompt))
            tokens = np.concatenate([prompt, self._new_tokens(max_tokens)])
            out.append(_Request(self._next_rid, tokens, len(prompt), max_tokens, arrival))
            self._next_rid += 1
        return out

    # ---- KV cache manager -------------------------------------------------------------------
    def _allocate(self, req: _Request, num_new: int, hit_blocks: list[int] = ()) -> bool:
        bs = self.sched.block_size
        need = -(-(req.num_computed + num_new) // bs) - len(req.blocks) - len(hit_blocks)
        evictable_hits = sum(1 for b in hit_blocks if self.pool.ref[b] == 0)
        if need > self.pool.num_free - evictable_hits:
            return False
        if hit_blocks:
            self.pool.touch(list(hit_blocks))
            req.blocks.extend(hit_blocks)
            req.num_cached = max(req.num_cached, len(req.blocks))
        if need > 0:
            req.blocks.extend(self.pool.take(need))
        if self.sched.enable_prefix_caching:
            full = min(req.num_computed + num_new, req.num_tokens) // bs
            for i in range(req.num_cached, full):
                self.pool.register(req.blocks[i], req.block_hash(i, bs))
            req.num_cached = max(req.num_cached, full)
        return True

    def _free(self, req: _Request) -> None:
        self.pool.release(req.blocks)
        req.blocks = []
        req.num_cached = 0

    # ---- scheduler ---------------------------------------------------------------------------
    @property
    def done(self) -> bool:
        return not self.running and not self.waiting and self._spawned == self.work.num_requests

    def schedule(self) -> list[tuple[_Request, int, int]]:
        """One scheduler step: [(request, context_len, query_len)] in batch order."""
        bs, budget = self.sched.block_size, self.sched.max_num_batched_tokens
        out: list[tuple[_Request, int, int]] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            remaining = req.num_tokens - req.num_computed
            if remaining == 1 and req.num_tokens > req.prompt_len:  # a decode: its drafts come with it
                remaining += self.sched.num_speculative_tokens
            num_new = min(remaining, budget, self.sched.max_model_len - req.num_computed)
            if num_new <= 0:
                i += 1
                continue
            while not self._allocate(req, num_new):
                victim = self.running.pop()
                self._free(victim)
                victim.num_computed = 0
                self.waiting.appendleft(victim)
                self.num_preemptions += 1
                preempted = True
                if victim is req:
                    break
            else:
                out.append((req, req.num_computed, num_new))
                budget -= num_new
                i += 1
                continue
            break
        while (not preempted and self.waiting and budget > 0
               and len(self.running) < self.sched.max_num_seqs):
            req = self.waiting[0]
            hits: list[int] = []
            if self.sched.enable_prefix_caching:
                max_hit = (req.num_tokens - 1) // bs
                hits = self.pool.lookup([req.block_hash(j, bs) for j in range(max_hit)])
            computed = len(hits) * bs
            num_new = req.num_tokens - computed
            if not self.sched.enable_chunked_prefill and num_new > budget:
                break
            num_new = min(num_new, budget)
            req.num_computed = computed
            if not self._allocate(req, num_new, hits):
                req.num_computed = 0
                break
            self.waiting.popleft()
            self.running.append(req)
            out.append((req, computed, num_new))
            budget -= num_new
        return out

    def _finish_step(self, scheduled: list[tuple[_Request, int, int]]) -> None:
        p = self.sched.draft_acceptance
        for req, ctx, num_new in scheduled:
            drafts = ctx + num_new - req.num_tokens  # > 0: a speculative decode with that many drafts
            if drafts > 0:
                accepted = int(np.argmin(np.r_[self._drafts_rng.random(drafts) < p, False]))  # leading successes
                accepted = min(accepted, req.prompt_len + req.max_tokens - req.num_tokens - 1,
                               self.sched.max_model_len - req.num_tokens - 1)
                req.num_computed = req.num_tokens + accepted  # the rejected drafts are rolled back
                req.num_tokens += accepted + 1  # the accepted drafts and the token sampled after them
                self._maybe_finish(req)
                continue
            req.num_computed = ctx + num_new
            if req.num_computed >= req.num_tokens:
                req.num_tokens += 1  # sampled one token
                self._maybe_finish(req)

    def _maybe_finish(self, req: _Request) -> None:
        """At its output length or at max_model_len a request finishes and frees its blocks."""
        if req.num_tokens - req.prompt_len >= req.max_tokens or req.num_tokens >= self.sched.max_model_len:
            self.running.remove(req)
            self._free(req)
            self.finished.append(req)
            if req.rid not in self._children:
                self._idle.append(req)

    def _admit_arrivals(self) -> None:
        while self._spawned < self.work.num_requests and self._arrivals[self._spawned] <= self.step_index:
            self.waiting.extend(self._spawn(int(self._arrivals[self._spawned])))
            self._spawned += 1

    _spawned = 0

    def steps(self, max_steps: int | None = None) -> Iterator[TraceStep]:
        """Run until every request finished (or `max_steps` steps were made); yield the non-empty steps."""
        bs = self.sched.block_size
        made = 0
        while not self.done and (max_steps is None or made < max_steps):
            self._admit_arrivals()
            scheduled = self.schedule()
            self.step_index += 1
            if not scheduled:
                if not self.running and self.waiting:
                    req = self.waiting[0]
                    if -(-req.num_tokens // bs) > self.sched.num_blocks - 1:
                        raise RuntimeError(f"request of {req.num_tokens} tokens needs more blocks than the cache has")
                continue
            q = np.fromiter((n for _, _, n in scheduled), dtype=np.int64, count=len(scheduled))
            c = np.fromiter((ctx for _, ctx, _ in scheduled), dtype=np.int64, count=len(scheduled))
            ids = [r.blocks[: -(-(ctx + n) // bs)] for r, ctx, n in scheduled]
            step = TraceStep(bs, q, c, ids)
            self._finish_step(scheduled)
            made += 1
            yield step


def simulate(sched: SchedulerConfig, workload: WorkloadConfig, seed: int = 0, max_steps: int | None = None,
             progress: Callable | None = None) -> list[TraceStep]:
    """All steps of one simulated run; `progress(n)` is called after each step if given."""
    sim = Simulator(sched, workload, seed)
    out = []
    for step in sim.steps(max_steps):
        out.append(step)
        if progress:
            progress(1)
    return out


def header_for(sched: SchedulerConfig, workload: WorkloadConfig, seed: int, name: str = "") -> dict:
    """The trace header a simulated trace carries: everything needed to make it again."""
    return {"source": "vllm_gaudi_unified.bucket_plans.simulator", "workload_name": name, "seed": seed,
            "scheduler": asdict(sched), "workload": asdict(workload)}
