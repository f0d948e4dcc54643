"""Checked flag types: every numeric flag of every command says its range, so nonsense stops at the parser;
and `env_flag`, the one reading of a boolean environment variable.

`--margin nan`, `--limit -1` or `--resolution 1e9` used to run (for minutes, or
to a silly result). A `CheckedType` is an argparse `type=` that converts and
checks in one step and raises `ArgumentTypeError` naming the range; argparse
then names the flag and the value. `tests/test_cli_robustness.py` checks that
no flag is left with a bare `type=int` or `type=float`.
"""
from __future__ import annotations

import argparse
import math
import os

from vllm_gaudi_unified.plan.options import TILE_LIMITS


class CheckedType:
    """`int` or `float` within `[lo, hi]` (None: unbounded; floats must be finite)."""

    def __init__(self, kind: type, lo=None, hi=None):
        self.kind, self.lo, self.hi = kind, lo, hi
        self.__name__ = kind.__name__  # argparse names the type in its messages

    def __call__(self, text: str):
        try:
            value = self.kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if self.kind is int else 'a number'}")
        if (self.kind is float and not math.isfinite(value)) or (self.lo is not None and value < self.lo) or \
                (self.hi is not None and value > self.hi):
            raise argparse.ArgumentTypeError(f"{text} is outside {self.describe()}")
        return value

    def describe(self) -> str:
        lo = "-inf" if self.lo is None else self.lo
        hi = "inf" if self.hi is None else self.hi
        return f"[{lo}, {hi}]" + (" (finite)" if self.kind is float else "")

    def bad_examples(self) -> list[str]:
        """Values this type must refuse (for the tests)."""
        out = ["x", "nan" if self.kind is float else "1.5"]
        if self.lo is not None:
            out.append(str(self.lo - 1))
        if self.hi is not None:
            out.append(str(self.hi + 1))
        return out

    def __repr__(self) -> str:
        return f"{self.kind.__name__} in {self.describe()}"


def int_in(lo: int | None = None, hi: int | None = None) -> CheckedType:
    return CheckedType(int, lo, hi)


def float_in(lo: float | None = None, hi: float | None = None) -> CheckedType:
    return CheckedType(float, lo, hi)


#: The common ones. Sizes stop at 2**40: far above any real setting, far below an int64 overflow.
POSITIVE = int_in(1, 2**40)
NON_NEGATIVE = int_in(0, 2**40)
SEED = int_in(0, 2**32 - 1)
JOBS = int_in(1, 1024)


#: The planner's tile options as flags, each with the planner's own range.
TILE = {name: int_in(1, limit) for name, limit in TILE_LIMITS.items()}


ENV_TRUE = ("1", "true", "yes", "on")
ENV_FALSE = ("0", "false", "no", "off")


def env_flag(name: str, environ=os.environ) -> bool | None:
    """True / False for a set boolean variable, None when unset or empty; anything else is an error (a
    misspelt value never silently means either)."""
    raw = environ.get(name, "").strip().lower()
    if not raw:
        return None
    if raw in ENV_TRUE:
        return True
    if raw in ENV_FALSE:
        return False
    raise ValueError(f"{name}={environ[name]!r}: expected one of {ENV_TRUE + ENV_FALSE}")


def comma_ints(text: str) -> str:
    """Flag type for '1,2,3' (non-negative integers): checked, and kept as text so that a plan's recorded
    command repeats it as given; `parse_comma_ints` reads it."""
    try:
        values = parse_comma_ints(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give at least one integer, none negative")
    return text


def comma_ints_in(lo: int, hi: int, what: str = "integers"):
    """Flag type for '16,128' whose every entry lies in [lo, hi] (block sizes, ...): checked, kept as text."""
    def check(text: str) -> str:
        try:
            values = parse_comma_ints(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of {what}") from None
        bad = [v for v in values if not lo <= v <= hi]
        if not values or bad:
            raise argparse.ArgumentTypeError(f"{text!r}: give {what} in [{lo}, {hi}]" +
                                             (f" ({bad[0]} is not)" if bad else ""))
        return text

    check.__name__ = f"list of {what}"
    check.describe = lambda: f"[{lo}, {hi}] each"
    return check


def step_window(text: str) -> tuple[int, int]:
    """`START:STOP` (0 <= START < STOP) as a pair of ints: a window of a trace's steps."""
    try:
        start, stop = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not START:STOP (two ints, e.g. 300:500)") from None
    if not 0 <= start < stop:
        raise argparse.ArgumentTypeError(f"{text!r} needs 0 <= START < STOP")
    return start, stop


def parse_comma_ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]
