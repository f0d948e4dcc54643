"""The bucket: the static shape of one step, one compiled graph per bucket.

A step's shape is what the planner needs to allocate: the padded number of new
tokens and the number of work items of each path. Padding a step to a larger
bucket only adds fully masked work, so any bucket whose every field is at least
the step's covers it.

Why six fields and not the five of DESIGN.md: once the causal path skips tiles
that pair tokens of different requests, its work is no longer a function of
`query_len` (one 2048-token prompt needs 136 tiles of 128, sixteen 128-token
prompts need 16), so the number of causal tiles is a shape of its own. The five
fields of the design keep their meaning and their order.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace

import numpy as np

PATHS = "csu"


def phase_of(num_causal_tiles: int, num_shared_blocks: int, num_unique_blocks: int) -> str:
    """'c', 's', 'u' for each path that has work, '-' for one that has none."""
    counts = (num_causal_tiles, num_shared_blocks, num_unique_blocks)
    return "".join(p if n > 0 else "-" for p, n in zip(PATHS, counts))


@dataclass(frozen=True, order=True)
class Bucket:
    """Shape of a step (unpadded) or of a compiled graph (padded)."""

    phase: str  #: 'csu', '--u', ...: which of causal / shared / unique run
    query_len: int  #: new tokens of the whole step, all requests together (padded): the rows of q/k/v
    num_shared_blocks: int  #: KV block slots the shared path gathers (tiles x blocks per tile)
    num_unique_blocks: int  #: block slots of the unique path (one query token each)
    num_logits: int  #: rows handed to the sampler (one per request, padded)
    num_causal_tiles: int = 0  #: query-tile x key-tile pairs of the causal path
    #: The prompt route (`plan/prompts.py`): requests whose new tokens and cached context run as one
    #: padded batch, one fused SDPA call, rows written final. Not among the five `sizes` the bucketing
    #: tools count: a bucket plan's bucket takes the step's, rounded up to powers of two (`with_prompts`).
    num_prompts: int = 0  #: requests on the prompt route (padded)
    prompt_len: int = 0  #: query rows per prompt (the longest, padded)
    prompt_blocks: int = 0  #: cached context blocks per prompt (the most, padded)

    def __post_init__(self):
        for name in SIZE_FIELDS + PROMPT_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:  # True is not a size
                raise ValueError(f"Bucket.{name} must be a non-negative int, got {value!r}")
        expected = phase_of(self.num_causal_tiles, self.num_shared_blocks, self.num_unique_blocks)
        if self.phase != expected:
            raise ValueError(f"Bucket.phase {self.phase!r} disagrees with its sizes (expected {expected!r})")

    @property
    def sizes(self) -> tuple[int, ...]:
        """The numeric fields, in declaration order."""
        return (self.query_len, self.num_shared_blocks, self.num_unique_blocks, self.num_logits, self.num_causal_tiles)

    @property
    def prompts(self) -> tuple[int, int, int]:
        """The prompt route's shape: (num_prompts, prompt_len, prompt_blocks); zeros when unused."""
        return (self.num_prompts, self.prompt_len, self.prompt_blocks)

    def covers(self, step: "Bucket") -> bool:
        """True when a step of shape `step` can be padded to this bucket."""
        return all(b >= s for b, s in zip(self.sizes + self.prompts, step.sizes + step.prompts))

    def __str__(self) -> str:
        """`csu:q512:s256:u512:l164:c21`: the phase, then each size after its letter, in `SIZE_FIELDS` order;
        `:p2x2048x48` after them when the prompt route runs (prompts x rows x context blocks)."""
        text = ":".join([self.phase] + [f"{letter}{n}" for letter, n in zip(SIZE_LETTERS, self.sizes)])
        return text + (":p{}x{}x{}".format(*self.prompts) if self.num_prompts else "")


#: The five sizes of a Bucket, in the one order every array of sizes uses (`Bucket.sizes`, plan files,
#: the cost model, the bucketing tools), with their short names and letters, and their indexes.
SIZE_FIELDS = tuple(f.name for f in fields(Bucket)[1:6])
PROMPT_FIELDS = ("num_prompts", "prompt_len", "prompt_blocks")
SIZE_NAMES = ("query", "shared", "unique", "logits", "causal")
SIZE_LETTERS = tuple(name[0] for name in SIZE_NAMES)
Q, S, U, L, C = range(len(SIZE_FIELDS))

#: Phase strings indexed by their code: bit 4 = causal, 2 = shared, 1 = unique.
PHASES = tuple(phase_of(code & 4, code & 2, code & 1) for code in range(8))


def phase_code(phase: str) -> int:
    """The code of a phase string (index into `PHASES`)."""
    return (4 if phase[0] == "c" else 0) | (2 if phase[1] == "s" else 0) | (1 if phase[2] == "u" else 0)


def codes_of(sizes) -> np.ndarray:
    """Phase codes of shapes `[N, 5]` (`SIZE_FIELDS` order)."""
    s = np.asarray(sizes)
    return ((s[:, C] > 0) * 4 + (s[:, S] > 0) * 2 + (s[:, U] > 0) * 1).astype(np.int64)


def bucket_from_sizes(sizes) -> Bucket:
    """The Bucket of five sizes in `SIZE_FIELDS` order (its phase follows from them)."""
    q, s, u, l, c = (int(x) for x in sizes)
    return Bucket(phase_of(c, s, u), q, s, u, l, c)


def pow2(n: int) -> int:
    """The smallest power of two >= n (0 for n <= 0: a dimension with no work stays empty)."""
    return 0 if n <= 0 else 1 << (int(n) - 1).bit_length()


def pow2_bucket(shape: Bucket) -> Bucket:
    """`shape` with every size rounded up to a power of two (its phase unchanged: an empty path stays
    empty): the buckets of steps no bucket plan describes, a few shapes, each compiled once."""
    return Bucket(shape.phase, *(pow2(n) for n in shape.sizes), *(pow2(n) for n in shape.prompts))


def with_prompts(bucket: Bucket, step: Bucket) -> Bucket:
    """`bucket` (found by its five sizes) with the prompt route's shape of `step`, each dimension
    rounded up to a power of two (an exponential bucketing of the prompt route: a few graphs);
    `bucket` itself when it already covers the step's prompts."""
    if all(b >= s for b, s in zip(bucket.prompts, step.prompts)):
        return bucket
    p, q, c = (max(b, pow2(s)) for b, s in zip(bucket.prompts, step.prompts))
    return replace(bucket, num_prompts=p, prompt_len=q, prompt_blocks=c)
