"""MLA decode at DeepSeek-V3 shapes (128 query heads, latent 512 + rope 64, bf16): unified attention in latent
space against the HBM floor of reading the latent cache once, and vllm-gaudi's `flat_pa_mla` run as torch ops
(loaded as `benchmarks/gaudi_peer.py` loads its ops.py).

`python -m benchmarks.mla_decode --out FILE.json [--profile] [--cases ...]` (CUDA). Scenarios:

* `decode_128x4k`: 128 decodes, 4096 tokens each (context 4095 + the new token);
* `shared_64x4k+256`: 64 decodes whose first 4096 tokens are one shared prefix (the same 32 blocks),
  then 256 of their own (4352 each);
* `unshared_64x4352`: the same lengths with no block in common (what the prefix costs when it is not shared);
* `decode_4x32k`, `decode_16x8k`: few decodes over long contexts (a step whose tokens' programs leave SMs idle
  unless their keys are split further: `mla_decode.MLA_FILL_SMS`; column `cuda_no_fill` without it);
* `shared_64x4k+256_*`: the shared one under other shared tile sizes (`PlanOptions`): `tiles64` one tile of
  64 rows x 4096 keys, `keys4096` 8 tiles of 8 rows x 4096 keys, `h100opts` the H100's server options
  (`bucket_plans/device_options.py`: 256 rows x 2048 keys, 2 tiles).

Floor: the latent bytes the step must read (each distinct cached block once) over the read bandwidth
measured in the same run (a sum over a 2 GiB bf16 tensor). Compute floor: the step's attention FLOPs
(`2 * heads * keys * (L + R + L)` per token) over the bf16 matmul rate measured in the same run (an
8192^3 matmul); at 128 heads a latent key costs ~240 FLOPs per byte, near an H100's ridge, so the
larger of the two floors is what a kernel can approach. Times: CUDA events, median of 20 after 3
warm-ups. Errors: max |out - float32 dense reference| over four requests.

Columns (`--cases` picks scenarios): the CUDA route (`paths/mla_decode.py`'s kernel on the unique
pairs and the shared ones; `cuda_shared_route`: those on `paths/mla_shared.py`;
`cuda_triton` / `cuda_gluon`: the Triton kernel or a Gluon kernel (`paths/mla_gluon_seesaw.py` where it
applies, else `paths/mla_gluon.py`), whatever the default; `cuda_gluon_shared` / `cuda_triton_shared`: a step's shared cells on the Gluon or the Triton kernel,
`MLA_GLUON_SHARED` on or off), the Gaudi route (`VLLM_GAUDI_UNIFIED_GAUDI_ROUTE`: torch
ops only, on the bucket-shaped paths an HPU graph holds: the unique pairs on `paths/mla_chunks.py`, the dense decode route
runs on the CPU only; `gaudi_unique_tiles`: the unique pairs on the generic tiles, the Gaudi route before
mla_chunks.py; `gaudi_broadcast_adds`: the chunks' mask and shift as broadcast adds, `MLA_CHUNK_RANK1` off; `gaudi_chunksN`, `--chunk-keys`: mla_chunks.py with `MLA_CHUNK_KEYS = N`),
each also with its shared pairs on the generic tiles (`*_generic_shared`: the route before mla_shared.py), the
generic tiles for every pair (`tiles`: `mla_unique_route` and `mla_shared_applies` off), vllm-gaudi.
`--profile`: each route's kernels over 5 steps (GPU time per step = the profile's CUDA total / 5).
"""
from __future__ import annotations

import contextlib
import json
import math
import statistics
import time
from unittest import mock

import torch

from vllm_gaudi_unified import attention, build_unified_batch
from vllm_gaudi_unified.mla import mla_attention
from vllm_gaudi_unified.paths import fused, mla_chunks, mla_decode, mla_shared
from vllm_gaudi_unified.files import atomic_write, output_path
from vllm_gaudi_unified.tools.cli import Parser

H, L, R, BS = 128, 512, 64, 128
SCALE = 192 ** -0.5  # DeepSeek-V3: (qk_nope 128 + rope 64) ** -0.5


def timed(fn, iters=20, warmup=3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def read_bandwidth() -> float:
    x = torch.ones(1 << 30, dtype=torch.bfloat16, device="cuda")
    ms = timed(lambda: x.sum(), iters=10)
    return x.numel() * 2 / (ms * 1e-3)


def matmul_rate() -> float:
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    ms = timed(lambda: a @ a, iters=10)
    return 2 * 8192 ** 3 / (ms * 1e-3)


#: The kernel's constants, recorded with every run.
REPORTED_CONSTS = ("MLA_BLOCK_H", "MLA_KEYS", "MLA_WARPS", "MLA_STAGES", "MLA_SPLIT_KEYS", "MLA_V_LOAD", "MLA_ONE_SLOT",
                   "MLA_Q_LOOP", "MLA_GLUON", "MLA_GLUON_KEYS", "MLA_GLUON_STAGES", "MLA_GLUON_PIPE",
                   "MLA_GLUON_LAZY_SUM", "MLA_GLUON_META_AHEAD", "MLA_GLUON_SHARED", "MLA_GLUON_DESC_CACHE",
                   "MLA_KERNEL_SHARED")


def gluon_kernel():
    """The CUDA route with the unique pairs on a Gluon kernel (sm_90: `paths/mla_gluon_seesaw.py` where its shapes
    allow, else `paths/mla_gluon.py`; where neither applies, the Triton kernel runs and the column repeats `cuda`)."""
    return mock.patch.object(mla_decode, "MLA_GLUON", True)


def no_fill():
    """The CUDA route with splits by keys alone (`mla_decode.MLA_FILL_SMS` off)."""
    return mock.patch.object(mla_decode, "MLA_FILL_SMS", False)


def triton_kernel():
    """The CUDA route with the unique pairs on the Triton kernel (`paths/mla_kernel.py`) whatever the default."""
    return mock.patch.object(mla_decode, "MLA_GLUON", False)


def gluon_shared():
    """The CUDA route with a step's shared cells on the Gluon kernel too (`MLA_GLUON_SHARED`)."""
    stack = contextlib.ExitStack()
    stack.enter_context(mock.patch.object(mla_decode, "MLA_GLUON", True))
    stack.enter_context(mock.patch.object(mla_decode, "MLA_GLUON_SHARED", True))
    return stack


def triton_shared():
    """The CUDA route with a step's shared cells on the Triton kernel (`MLA_GLUON_SHARED` off)."""
    return mock.patch.object(mla_decode, "MLA_GLUON_SHARED", False)


def shared_route():
    """The CUDA route's shared pairs on `paths/mla_shared.py` (the route before the kernel took them)."""
    return mock.patch.object(mla_decode, "MLA_KERNEL_SHARED", False)


@contextlib.contextmanager
def generic_shared():
    """The shared pairs on the generic tiles (the route before `paths/mla_shared.py`)."""
    with shared_route(), mock.patch.object(attention, "mla_shared_applies", lambda *args: False):
        yield


@contextlib.contextmanager
def tiles_only():
    """Every pair on the generic paths (the route before `paths/mla_decode.py` and `paths/mla_shared.py`)."""
    with mock.patch.object(attention, "mla_unique_route", lambda *args: None), generic_shared():
        yield


@contextlib.contextmanager
def gaudi_unique_tiles():
    """The Gaudi route with the unique pairs on the generic tiles (before `paths/mla_chunks.py`)."""
    with fused.gaudi_route(), mock.patch.object(attention, "mla_unique_route", lambda *args: None):
        yield


def gaudi_chunk_keys(keys: int):
    """The Gaudi route with `mla_chunks.MLA_CHUNK_KEYS = keys`."""
    @contextlib.contextmanager
    def ctx():
        with fused.gaudi_route(), mock.patch.object(mla_chunks, "MLA_CHUNK_KEYS", keys):
            yield
    return ctx


@contextlib.contextmanager
def gaudi_broadcast_adds():
    """The Gaudi route with the chunks' mask and shift as broadcast adds (`mla_chunks.MLA_CHUNK_RANK1` off)."""
    with fused.gaudi_route(), mock.patch.object(mla_chunks, "MLA_CHUNK_RANK1", False):
        yield


@contextlib.contextmanager
def gaudi_generic_shared():
    with fused.gaudi_route(), generic_shared():
        yield


def product_softmax():
    """`latent_attend`'s e^(s - max) in bf16, in place (`mla_shared.LATENT_SOFTMAX`)."""
    return mock.patch.object(mla_shared, "LATENT_SOFTMAX", "product")


@contextlib.contextmanager
def gaudi_product_softmax():
    with fused.gaudi_route(), product_softmax():
        yield


def make_step(seq_lens, shared_blocks: int):
    """Block tables (request r: the shared blocks, then its own), the cache, queries, new latents."""
    g = torch.Generator(device="cuda").manual_seed(0)
    n = len(seq_lens)
    own = [math.ceil(s / BS) - shared_blocks for s in seq_lens]
    table, nxt = [], 1 + shared_blocks
    for o in own:
        table.append(list(range(1, 1 + shared_blocks)) + list(range(nxt, nxt + o)))
        nxt += o
    width = max(map(len, table))
    table = [t + [0] * (width - len(t)) for t in table]
    cache = torch.randn(nxt, BS, L + R, generator=g, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(n, H, L + R, generator=g, device="cuda", dtype=torch.bfloat16)
    latent = torch.empty(n, L + R, device="cuda", dtype=torch.bfloat16)
    for r, s in enumerate(seq_lens):  # the new token's latent is the one in its slot (written before attention)
        pos = s - 1
        latent[r] = cache[table[r][pos // BS], pos % BS]
    distinct = shared_blocks + sum(own)
    return table, cache, q, latent, distinct


def dense_reference(q, cache, table, seq_lens, rows):
    out = []
    for r in rows:
        blocks = torch.tensor(table[r][: math.ceil(seq_lens[r] / BS)], device="cuda")
        kv = cache[blocks].flatten(0, 1)[: seq_lens[r]].float()  # [S, L + R]
        p = torch.softmax(q[r].float() @ kv.T * SCALE, -1)
        out.append(p @ kv[:, :L])
    return torch.stack(out)


def gaudi_mla(q, cache, table, seq_lens):
    """vllm-gaudi's `ops.flat_pa_mla` with the decode metadata its runner builds (gaudi_peer helpers)."""
    from benchmarks import gaudi_peer as gp

    vg = gp.load_vllm_gaudi()
    blocks, groups, mapping, bias = gp.decode_metadata(table, seq_lens, BS, "cuda", q.dtype)
    args = gp._common_args(vg, SCALE, cache.view(-1, 1, L + R), None, blocks, BS)
    for k in ("fsdpa_op", "softmax_op", "sinks", "k_scales", "v_scales", "scale"):
        args.pop(k, None)

    def run():
        return vg.ops.flat_pa_mla(query=q, block_mapping=mapping, block_bias=bias, block_groups=groups, scale=SCALE,
                                  kv_lora_rank=L, **args)
    return run


def setup(name, seq_lens, shared_blocks, options=None):
    """A scenario's tensors, batch, step function and reference rows."""
    table, cache, q, latent, distinct = make_step(seq_lens, shared_blocks)
    n = len(seq_lens)
    batch = build_unified_batch([1] * n, [s - 1 for s in seq_lens], table, BS, device="cuda", options=options)
    rows = [0, 1, n // 2, n - 1]
    ref = dense_reference(q, cache, table, seq_lens, rows)
    entry = {"requests": n, "seq_len": seq_lens[0], "phase": batch.phase, "bucket": str(batch.bucket),
             "plan_options": str(options) if options else "default",
             "latent_bytes_read_once": distinct * BS * (L + R) * 2,
             "attention_flops": 2 * H * sum(seq_lens) * (L + R + L)}
    return dict(name=name, table=table, cache=cache, q=q, seq_lens=seq_lens, entry=entry, batch=batch,
                err=lambda out: (out[rows].float() - ref).abs().max().item(),
                run=lambda: mla_attention(q, latent, cache, batch, SCALE, L),
                step=lambda: mla_attention(q, latent, cache, batch, SCALE, L, checked=True))


def measure(case, rates, report, profile=False, chunk_keys=()):
    bandwidth, flop_rate = rates
    entry, err, step = case["entry"], case["err"], case["step"]
    entry["floor_ms"] = entry["latent_bytes_read_once"] / bandwidth * 1e3
    entry["compute_floor_ms"] = entry["attention_flops"] / flop_rate * 1e3
    routes = {"cuda": contextlib.nullcontext, "cuda_no_fill": no_fill, "cuda_triton": triton_kernel,
              "cuda_gluon": gluon_kernel,
              "cuda_gluon_shared": gluon_shared, "cuda_triton_shared": triton_shared,
              "cuda_shared_route": shared_route, "cuda_generic_shared": generic_shared,
              "cuda_product_softmax": product_softmax, "gaudi": fused.gaudi_route,
              "gaudi_generic_shared": gaudi_generic_shared, "gaudi_product_softmax": gaudi_product_softmax,
              "gaudi_unique_tiles": gaudi_unique_tiles, "gaudi_broadcast_adds": gaudi_broadcast_adds,
              "tiles": tiles_only,
              **{f"gaudi_chunks{k}": gaudi_chunk_keys(k) for k in chunk_keys}}
    if "shared" not in case["name"]:  # (no shared pairs: the same as the columns beside them)
        del routes["cuda_generic_shared"], routes["gaudi_generic_shared"], routes["cuda_product_softmax"]
        del routes["cuda_shared_route"], routes["cuda_gluon_shared"], routes["cuda_triton_shared"]
    for route, ctx in routes.items():
        try:
            with ctx():
                entry[f"{route}_max_err"] = err(case["run"]())
                entry[f"{route}_ms"] = timed(step)
                if profile:
                    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                        for _ in range(5):
                            step()
                        torch.cuda.synchronize()
                    entry[f"{route}_profile"] = prof.key_averages().table(
                        sort_by="cuda_time_total", row_limit=14, max_name_column_width=70)
        except Exception as exc:  # reported, not hidden
            entry[f"{route}_error"] = f"{type(exc).__name__}: {exc}"[:500]
    if "+256_" not in case["name"] and not case["skip_vllm_gaudi"]:  # (other tiles: the same as the default's)
        try:
            run = gaudi_mla(case["q"], case["cache"], case["table"], case["seq_lens"])
            entry["vllm_gaudi_max_err"] = err(run())
            entry["vllm_gaudi_ms"] = timed(run)
        except Exception as exc:  # reported, not hidden
            entry["vllm_gaudi_error"] = f"{type(exc).__name__}: {exc}"[:500]
    floor = max(entry["floor_ms"], entry["compute_floor_ms"])
    for route in (*routes, "vllm_gaudi"):
        if f"{route}_ms" in entry:
            entry[f"{route}_over_floor"] = entry[f"{route}_ms"] / entry["floor_ms"]
            entry[f"{route}_over_max_floor"] = entry[f"{route}_ms"] / floor
    report[case["name"]] = entry
    print(case["name"], json.dumps({k: v for k, v in entry.items() if "profile" not in k}),
          flush=True)
    for k, v in entry.items():
        if "profile" in k:
            print(case["name"], k, "\n" + v, flush=True)


def main() -> None:
    parser = Parser(description=__doc__)
    parser.add_argument("--out", type=output_path, required=True)
    parser.add_argument("--profile", action="store_true", help="each route's kernels, 5 steps (the decode_* and shared steps)")
    parser.add_argument("--skip-vllm-gaudi", action="store_true", help="(its times do not change from run to run)")
    parser.add_argument("--cases", help="comma-separated scenario names (default: all)")
    parser.add_argument("--chunk-keys", default="",
                        help="comma-separated MLA_CHUNK_KEYS values, each a Gaudi-route column gaudi_chunksN")
    parser.add_argument("--heads", type=int, default=H,
                        help="query heads a token (128: DeepSeek-V3; 16: its tensor-parallel shard on 8 devices)")
    args = parser.parse_args()
    if args.heads < 1:
        raise ValueError(f"--heads must be at least 1, got {args.heads}")
    globals()["H"] = args.heads
    start = time.time()
    rates = read_bandwidth(), matmul_rate()
    report = {"device": torch.cuda.get_device_name(), "heads": H, "read_bandwidth_GBps": rates[0] / 1e9,
              "matmul_TFLOPs": rates[1] / 1e12,
              "kernel_consts": {k: getattr(mla_decode, k) for k in REPORTED_CONSTS}}
    print(report, flush=True)
    from vllm_gaudi_unified import PlanOptions

    cases = [setup("decode_128x4k", [4096] * 128, 0), setup("shared_64x4k+256", [4096 + 256] * 64, 4096 // BS),
             setup("unshared_64x4352", [4096 + 256] * 64, 0), setup("decode_4x32k", [32768] * 4, 0),
             setup("decode_16x8k", [8192] * 16, 0),
             setup("shared_64x4k+256_tiles64", [4096 + 256] * 64, 4096 // BS,
                   PlanOptions(shared_rows=64, shared_tile_keys=4096)),
             setup("shared_64x4k+256_keys4096", [4096 + 256] * 64, 4096 // BS, PlanOptions(shared_tile_keys=4096)),
             setup("shared_64x4k+256_h100opts", [4096 + 256] * 64, 4096 // BS,
                   PlanOptions(shared_rows=256, shared_tile_keys=2048))]
    if args.cases:
        names = args.cases.split(",")
        unknown = sorted(set(names) - {c["name"] for c in cases})
        if unknown:
            raise ValueError(f"--cases: no scenario {unknown}")
        cases = [c for c in cases if c["name"] in names]
    chunk_keys = [int(k) for k in args.chunk_keys.split(",") if k]
    report["mla_chunk_keys"] = mla_chunks.MLA_CHUNK_KEYS
    for case in cases:
        case["skip_vllm_gaudi"] = args.skip_vllm_gaudi
        profiled = args.profile and "+256_" not in case["name"] and case["name"] != "unshared_64x4352"
        measure(case, rates, report, profiled, chunk_keys)
        with atomic_write(args.out) as f:  # as it goes: a run cut short keeps what it measured
            json.dump(report, f, indent=1)
    report["wall_s"] = time.time() - start
    with atomic_write(args.out) as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
