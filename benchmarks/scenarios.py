"""The benchmark scenarios: each a step vLLM could schedule, with its block table.

Shapes are a Llama-3-8B layer's (32 query heads, 8 KV heads, head size 128, bf16); `scale`
shrinks request counts and lengths for CPU runs and tests. Block ids are drawn
the way a warm block manager hands them out: a random permutation, over a cache
just large enough ("dense"), or over a cache `spread` times larger than needed
("scattered": the largest id is far above the number of live blocks).

The block table covers `context_len + query_len` tokens (vLLM allocates the new
tokens' slots before attention), so baselines that read the new tokens from the
cache (FlexAttention over the paged cache) find them there.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class Scenario:
    name: str
    title: str
    query_lens: tuple  #: per request
    context_lens: tuple  #: per request
    prefix: tuple = ()  #: (first request, request count, common tokens): groups sharing their first blocks
    spread: float = 1.0  #: cache size / blocks needed (1 = dense)
    heads: tuple = (32, 8, 128)  #: (query heads, KV heads, head size) the scenario is timed at

    @property
    def num_requests(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return int(sum(self.query_lens))


@dataclass
class Layout:
    """A scenario made concrete for one block size."""

    scenario: Scenario
    block_size: int
    block_table: np.ndarray  #: [R, max blocks] int64, -1 past a request's blocks
    num_blocks: int
    owned: list = field(default_factory=list)  #: per request: its physical blocks in order


def _rep(n: int, value) -> tuple:
    return (value,) * n


def _scaled(n: int, scale: float, minimum: int = 1) -> int:
    return max(minimum, int(round(n * scale)))


def scenarios(scale: float = 1.0, seed: int = 0) -> list[Scenario]:
    """All scenarios; `scale` < 1 shrinks counts and lengths (CPU runs, tests)."""
    s = lambda n, m=1: _scaled(n, scale, m)  # noqa: E731
    rng = np.random.default_rng(seed)
    ragged = tuple(int(x) for x in rng.integers(s(64), s(8192) + 1, size=s(256)))
    return [
        Scenario("decode_256x2k", "decode 256 x 2k", _rep(s(256), 1), _rep(s(256), s(2048))),
        Scenario("decode_64x8k", "decode 64 x 8k", _rep(s(64), 1), _rep(s(64), s(8192))),
        Scenario("decode_ragged", "decode 256, ctx 64..8k", _rep(len(ragged), 1), ragged),
        Scenario("prefill_4x2k", "prefill 4 x 2k", _rep(4, s(2048)), _rep(4, 0)),
        Scenario("chunked_2x2k_6k", "chunked prefill 2 x 2k over 6k", _rep(2, s(2048)), _rep(2, s(6144))),
        Scenario("mixed", "mixed 4 x 512 over 1.5k + 256 decodes x 2k",
                 _rep(4, s(512)) + _rep(s(256), 1), _rep(4, s(1536)) + _rep(s(256), s(2048))),
        Scenario("shared_prefix", "shared prefix 64 x (4k + 256)", _rep(s(64), 1), _rep(s(64), s(4096) + s(256)),
                 prefix=((0, s(64), s(4096)),)),
        Scenario("parallel_sampling", "parallel sampling 16 x (2k + 64)", _rep(16, 1), _rep(16, s(2048) + s(64)),
                 prefix=((0, 16, s(2048)),)),
        Scenario("scattered", "decode 256 x 2k, blocks over a 6x cache", _rep(s(256), 1), _rep(s(256), s(2048)),
                 spread=6.0),
        # prompt shapes beside the first ones (goals re-measured on cases the code was not tuned on): one long
        # chunk, many short ones, ragged chunks over ragged contexts with a fresh prompt among them (partial
        # last blocks, a context of 0 in a bucket with context), ragged prompts without context
        Scenario("chunked_1x4k_12k", "chunked prefill 1 x 4k over 12k", (s(4096),), (s(12288),)),
        Scenario("chunked_8x512_2k", "chunked prefill 8 x 512 over 2k", _rep(8, s(512)), _rep(8, s(2048))),
        Scenario("chunked_ragged", "chunked prefill 256/1k/1.9k/700 over 7k/300/1.5k/0",
                 (s(256), s(1024), s(1900), s(700)), (s(7000), s(300), s(1500), 0)),
        Scenario("prefill_ragged", "prefill 100/1.5k/3k/700", (s(100), s(1500), s(3000), s(700)), _rep(4, 0)),
        Scenario("parallel_sampling_h8", "parallel sampling 16 x (2k + 64), heads 8/1/128 (a 70B at TP 8)", _rep(16, 1),
                 _rep(16, s(2048) + s(64)), prefix=((0, 16, s(2048)),), heads=(8, 1, 128)),
    ]


def layout(sc: Scenario, block_size: int, seed: int = 0) -> Layout:
    """Block table and cache size; prefix groups reuse the full blocks of their first request."""
    rng = np.random.default_rng(seed)
    bs = block_size
    need = [-(-(c + q) // bs) for q, c in zip(sc.query_lens, sc.context_lens)]
    share = {}  # request -> (owner request, shared full blocks)
    for first, count, common in sc.prefix:
        for r in range(first + 1, first + count):
            share[r] = (first, common // bs)
    live = sum(n - share.get(r, (0, 0))[1] for r, n in enumerate(need))
    num_blocks = max(live + 1, int(np.ceil(live * sc.spread)) + 1)
    free = iter(rng.permutation(np.arange(1, num_blocks))[:live])  # block 0: vLLM's null block
    table = np.full((sc.num_requests, max(need)), -1, np.int64)
    for r, n in enumerate(need):
        owner, common = share.get(r, (r, 0))
        for i in range(n):
            table[r, i] = table[owner, i] if i < common else next(free)
    owned = [table[r, :n].copy() for r, n in enumerate(need)]
    return Layout(sc, bs, table, num_blocks, owned)


def verify_scenarios(scale: float = 1.0, seed: int = 0) -> list[Scenario]:
    """Speculative verify steps: each request its last token and k drafts over its cached context;
    ragged drafts (an ngram proposer that found none for some requests); other head shapes (Hq / Hkv / D)."""
    s = lambda n, m=1: _scaled(n, scale, m)  # noqa: E731
    rng = np.random.default_rng(seed)
    n = s(96)
    ragged_q = tuple(int(x) for x in rng.integers(1, 9, size=n))
    ragged_c = tuple(int(x) for x in rng.integers(s(1024), s(6144) + 1, size=n))
    v = lambda k, heads=(32, 8, 128), suffix="": Scenario(  # noqa: E731
        f"verify_64x{1 + k}_3k{suffix}", f"verify 64 x ({1 + k} over 3k), heads {'/'.join(map(str, heads))}",
        _rep(s(64), 1 + k), _rep(s(64), s(3072)), heads=heads)
    return [
        v(1), v(3), v(7), v(3, (64, 8, 64), "_h64"), v(3, (8, 1, 128), "_h8"),
        Scenario("verify_ragged_96", "verify 96 requests, 1-8 new tokens over 1k-6k", ragged_q, ragged_c),
        Scenario("verify_16x2_16k", "verify 16 x (2 over 16k)", _rep(16, 2), _rep(16, s(16384))),
    ]
