"""Named batch specs and a step builder shared by the core tests.

A step is built the way vLLM's block manager would lay it out: each request owns
the blocks covering `context_len + query_len` tokens, drawn from a shuffled free
list (block 0 is reserved as the null block and never used), requests of a
prefix group reuse the first full blocks of the group's first request, and
block-table entries past a request's need hold -1. Every cache slot no request
may read holds NaN or inf, so reading one shows up as a NaN in the output.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import pytest
import torch

from vllm_gaudi_unified import PlanOptions, build_unified_batch, unified_attention
from vllm_gaudi_unified.reference import reference_attention

import cpu_features  # noqa: E402  (tests/ is on sys.path)
import vllm_helpers  # noqa: E402

# Before any vLLM import or engine subprocess (they inherit the environment): with vllm-gaudi
# installed on a machine without Gaudi software, vLLM must not load vllm-gaudi's plugins.
vllm_helpers.keep_vllm_gaudi_out()
# UNIFIED_TEST_CPU=avx2: vLLM (here and in engine subprocesses) sees a CPU without AVX-512 / AMX.
cpu_features.force_from_env()


def pytest_report_header(config):
    return cpu_features.describe()


def pytest_collection_modifyitems(config, items):
    """`multimodal` tests run where torchvision loads beside torch (the venv scripts/multimodal_venv.sh builds);
    elsewhere they skip, naming why."""
    marked = [item for item in items if item.get_closest_marker("multimodal")]
    reason = marked and torchvision_missing()
    if reason:
        skip = pytest.mark.skip(reason=reason)
        for item in marked:
            item.add_marker(skip)


def torchvision_missing() -> str | None:
    """Why vLLM's vision models cannot load in this venv, or None. Checked in a child process: a torchvision
    built for another torch fails halfway through its import and leaves `import transformers` broken."""
    import importlib.util
    import os
    import subprocess
    import sys

    where = "the multimodal tests run in the second venv that scripts/test.sh builds (scripts/multimodal_venv.sh)"
    if os.environ.get("UNIFIED_MULTIMODAL_SKIP"):  # scripts/test.sh: why that venv is missing
        where += f"; {os.environ['UNIFIED_MULTIMODAL_SKIP']}"
    if importlib.util.find_spec("torchvision") is None:
        return f"torchvision is not installed here: {where}"
    probe = "import torch, torchvision; torchvision.ops.nms(torch.zeros(1, 4), torch.zeros(1), 0.5)"
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    if proc.returncode:
        last = (proc.stderr.strip().splitlines() or ["(no message)"])[-1]
        return f"torchvision does not run beside this torch ({last}): {where}"
    return None


def pytest_terminal_summary(terminalreporter):
    """The CPU features the run saw, in every log (the header is hidden under -q): which reference
    comparisons could run depends on them."""
    terminalreporter.write_line(cpu_features.describe())

#: The suite's tensors are tiny: one intra-op thread is faster than several, and far faster on a
#: shared machine, where torch's waiting threads spin for cores (the random invariance tests ran 10x
#: longer with two threads under load). Tests that should see torch's own threading ask for
#: `torch_threads`.
TORCH_THREADS = torch.get_num_threads()
torch.set_num_threads(1)


@pytest.fixture
def torch_threads():
    """torch's default intra-op thread count for the duration of one test."""
    torch.set_num_threads(TORCH_THREADS)
    yield TORCH_THREADS
    torch.set_num_threads(1)


#: Small tiles so that small tests still cross tile boundaries.
SMALL_TILES = PlanOptions(causal_tile=4, shared_rows=4, shared_rows_max=4, shared_tile_keys=8)  # rows fixed: many row chunks
#: SMALL_TILES with every pair on the tiled paths (no prompt route): tests of the tiles themselves.
TILES = replace(SMALL_TILES, prompt_route="tiles")


@dataclass
class Step:
    query_lens: list
    context_lens: list
    block_size: int
    prefix_groups: list = field(default_factory=list)  # [(request indices, shared full blocks)]
    num_qo_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 8
    num_blocks: int | None = None  # default: just enough, plus the null block and some spare


#: name -> Step. Phases in the comments are the planner's, with SMALL_TILES.
SPECS = {
    "seed": Step([8, 4, 1, 1], [0, 4, 6, 4], 4, prefix_groups=[([1, 3], 1)]),  # csu
    "decode": Step([1] * 6, [5, 17, 1, 32, 9, 64], 8),  # --u
    "prefill": Step([7, 16, 3, 1], [0, 0, 0, 0], 4),  # c--
    "chunked_prefill": Step([12, 5], [20, 9], 4),  # cs-
    "prefix_caching": Step([1, 1, 1, 6], [16, 18, 21, 16], 4, prefix_groups=[([0, 1, 2, 3], 4)]),  # csu
    "parallel_sampling": Step([1, 1, 1, 1], [13, 13, 13, 13], 4, prefix_groups=[([0, 1, 2, 3], 3)]),  # -su
    "ragged_partial": Step([3, 1, 9, 2, 1], [13, 30, 7, 1, 2], 8),  # csu
    "long_causal": Step([37, 1], [3, 40], 4),  # causal longer than many tiles
    "gqa": Step([5, 1, 1], [6, 11, 3], 4, num_qo_heads=8, num_kv_heads=2),
    "mqa": Step([5, 1, 1], [6, 11, 3], 4, num_qo_heads=6, num_kv_heads=1),
}


def make_block_table(step: Step, rng: np.random.Generator, spare: int = 7) -> tuple[np.ndarray, int]:
    bs = step.block_size
    need = [-(-(c + q) // bs) for q, c in zip(step.query_lens, step.context_lens)]
    num_blocks = step.num_blocks or sum(need) + 1 + spare
    free = list(rng.permutation(np.arange(1, num_blocks)))  # block 0 = null block
    table = np.full((len(need), max(need) + 2), -1, np.int64)
    shared = {}
    for members, n in step.prefix_groups:
        for r in members[1:]:
            shared[r] = (members[0], n)
    for r, n in enumerate(need):
        for i in range(n):
            owner = shared.get(r)
            table[r, i] = table[owner[0], i] if owner and i < owner[1] else free.pop()
    return table, num_blocks


def make_tensors(step: Step, table: np.ndarray, num_blocks: int, dtype=torch.float64, seed: int = 0):
    """Random q/k/v and caches; every slot no request may read is poisoned with NaN or inf."""
    g = torch.Generator().manual_seed(seed)
    t = sum(step.query_lens)
    hq, hkv, d, bs = step.num_qo_heads, step.num_kv_heads, step.head_dim, step.block_size
    rand = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)
    q, k, v = rand(t, hq, d), rand(t, hkv, d), rand(t, hkv, d)
    kc, vc = rand(num_blocks, bs, hkv, d), rand(num_blocks, bs, hkv, d)
    readable = torch.zeros(num_blocks, bs, dtype=torch.bool)
    for r, c in enumerate(step.context_lens):
        for pos in range(c):
            readable[table[r, pos // bs], pos % bs] = True
    kc[~readable] = float("nan")
    vc[~readable] = float("inf")
    return q, k, v, kc, vc


def run_case(step: Step, *, dtype=torch.float64, options=SMALL_TILES, seed: int = 0, bucket=None, scale=0.37,
             **attn_kwargs):
    """-> (output, reference, batch). `sliding_window` in attn_kwargs goes to the planner too."""
    rng = np.random.default_rng(seed)
    table, num_blocks = make_block_table(step, rng)
    q, k, v, kc, vc = make_tensors(step, table, num_blocks, dtype, seed)
    window = attn_kwargs.pop("sliding_window", None)
    batch = build_unified_batch(step.query_lens, step.context_lens, table, step.block_size, sliding_window=window,
                                num_blocks=num_blocks, options=options, bucket=bucket)
    out = unified_attention(q, k, v, kc, vc, batch, scale, **attn_kwargs)
    ref = reference_attention(q, k, v, kc, vc, step.query_lens, step.context_lens, table, scale,
                              sliding_window=window, **attn_kwargs)
    return out, ref, batch


def assert_matches(out: torch.Tensor, ref: torch.Tensor):
    """float64 within 1e-6; bf16/fp16 within 1e-2 (fp32 accumulation); fp32 within 1e-4."""
    tol = {torch.float64: 1e-6, torch.float32: 1e-4}.get(out.dtype, 1e-2)
    assert torch.isfinite(out).all(), "output holds NaN/inf: a poisoned cache slot was read"
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


def record_calls(monkeypatch, module, name: str, adapt=None) -> list:
    """`module.name` replaced by a wrapper that keeps each call's result in the list returned (its length
    counts the calls); `adapt(args)` may change the positional arguments first. Tests read the routes taken."""
    real, seen = getattr(module, name), []

    def wrapper(*args, **kwargs):
        seen.append(real(*(adapt(args) if adapt else args), **kwargs))
        return seen[-1]

    monkeypatch.setattr(module, name, wrapper)
    return seen


def on_meta(args: tuple) -> tuple:
    """A route's (batch, query, ...) with the query on the meta device: the route as off the CPU."""
    return (args[0], args[1].to("meta"), *args[2:])


@pytest.fixture(params=sorted(SPECS))
def spec_name(request):
    return request.param


def skip_unless_interpreter_indexes_loop_bounds() -> None:
    """Skip under a Triton whose interpreter cannot take a tensor as a `range` bound (before 3.9 it
    calls `int()` of a 1-element array, which NumPy >= 2.5 refuses: seen with 3.6 on the GPU machine);
    the unique kernel's loop needs it."""
    from importlib.metadata import version

    if tuple(int(x) for x in version("triton").split(".")[:2]) < (3, 9):
        pytest.skip("this Triton's interpreter cannot run the kernel's loop (needs Triton >= 3.9)")


def run_interpreted(script: str) -> list[str]:
    """`tests/<script>` (a kernel's case runner) in a process of its own under Triton's interpreter
    (TRITON_INTERPRET=1 must be set before triton is first imported): the words it printed, after a
    clean exit. Skips where the interpreter cannot run the kernels' loops."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    skip_unless_interpreter_indexes_loop_bounds()
    tests = Path(__file__).resolve().parent
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join([str(tests.parent), str(tests), os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, str(tests / script)], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run.stdout.split()
