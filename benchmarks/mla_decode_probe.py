"""Where an MLA decode step's GPU time goes, route by route, and the Triton kernel's constants with what limits
each (registers, spills, shared memory, whether Hopper's `wgmma` is used), at DeepSeek-V3 shapes (128 x 4096
keys, `benchmarks/mla_decode.py`'s scenario).

`python -m benchmarks.mla_decode_probe --out FILE.json` (CUDA). Parts:

* `gaudi_ops` / `cuda_ops`: one step of each route under the profiler, its GPU time by torch op (what
  a step spends in the gather, each product, each softmax pass, the merge);
* `pieces`: the Gaudi route's pieces timed alone on tensors laid out once: the per-slot gather
  (`mla_decode.dense_mla_partial`'s) against a per-block one (what `index_select` over block ids costs: an
  HPU's gather engine prefers whole blocks), the two products, `latent_attend` whole, and the route
  over chunks of requests whose gathered latents fit in L2;
* `kernel`: each constant set of `KERNELS` on the whole step (error against the dense reference, median
  time, kernel time alone, TFLOP/s of the kernel, its registers, spills and shared memory); `--best FILE`
  keeps the fastest correct set for `benchmarks.mla_decode --consts FILE`; `--kernels-only` stops there.

`--gluon`: the kernel part for the shipped Triton constants and the Gluon kernel's variants (`GLUON`,
`paths/mla_gluon.py`) side by side, nothing else (run 10).

`--once FILE` runs three steps of the CUDA route with the constants in FILE and nothing else: the process
to hand a profiler (`ncu -k regex:mla_body -c 1 ... python -m benchmarks.mla_decode_probe --out /dev/null
--once FILE`, run 9); `--once-shared`: on the shared step (run 13: how many bytes the Gluon kernel reads from HBM).
`--gluon-shared`: the Gluon rows also on the shared step (run 14). `--gluon-rows GLUON_13` also times the host's
share of a launch with and without the kept TMA descriptors.
"""
from __future__ import annotations

import contextlib
import json
from unittest import mock

import torch

from benchmarks.mla_decode import BS, H, KERNEL_CONSTS, L, SCALE, kernel_consts, matmul_rate, read_bandwidth, setup
from benchmarks.mla_decode import timed
from vllm_gaudi_unified.paths import fused, mla_decode, mla_kernel
from vllm_gaudi_unified.files import output_path
from vllm_gaudi_unified.tools.cli import Parser
from vllm_gaudi_unified.paths.mla_shared import latent_attend

#: (heads per program, keys per step, warps, stages, keys a split aims at, V_LOAD, ONE_SLOT[, Q_LOOP]): run 6's
#: sweep; runs 8 and 9 swept switches since removed (their rows: benchmarks/results/mla_h100/run8_*, run9_*)
KERNELS = [
    (32, 32, 4, 2, 16384, 0, False),  # run 5's constants (before ONE_SLOT)
    (32, 32, 4, 2, 16384, 0, True),
    (64, 64, 8, 1, 16384, 0, True),
    (64, 64, 8, 2, 16384, 0, True),
    (64, 32, 8, 2, 16384, 0, True),
    (64, 32, 8, 3, 16384, 0, True),
    (64, 32, 8, 4, 16384, 0, True),
    (64, 32, 8, 3, 2048, 0, True),
    (64, 64, 8, 2, 2048, 0, True),
    (64, 32, 8, 2, 16384, 1, True),
    (64, 64, 8, 2, 16384, 0, True, True),
    (64, 32, 8, 3, 16384, 0, True, True),
    (64, 128, 8, 1, 16384, 0, True),
    (32, 64, 4, 2, 16384, 0, True),
]
CONSTS = (*KERNEL_CONSTS, "MLA_ONE_SLOT", "MLA_Q_LOOP")
#: The Gluon kernel's variants (run 10): keys per tile, ring stages, when the next tile's scores are issued
#: (`PIPE`: 0 after this tile, 1 before its softmax, 2 after its values product), sums per key column
#: (`LAZY_SUM`), keys a split aims at (16384: one split at 4096 keys; 2048: two)
GLUON = [dict(MLA_GLUON_KEYS=keys, MLA_GLUON_STAGES=stages, MLA_GLUON_PIPE=pipe, MLA_GLUON_LAZY_SUM=lazy,
              MLA_SPLIT_KEYS=split)
         for keys, stages, pipe, lazy, split in [(64, 2, 0, False, 16384), (64, 2, 0, True, 16384),
                                                 (64, 2, 1, False, 16384), (64, 2, 2, False, 16384),
                                                 (64, 2, 2, True, 16384), (64, 2, 1, True, 16384),
                                                 (32, 4, 2, True, 16384), (32, 4, 1, True, 16384),
                                                 (64, 2, 2, True, 2048)]]
#: Run 10's third call: META_AHEAD (`mla_gluon.py`) beside the best of the second (its warp-specialised rows: a
#: variant since removed, docs/benchmarks.md, MLA, kernel runs 10 and 13)
GLUON_C = [dict(MLA_GLUON_PIPE=pipe, MLA_GLUON_LAZY_SUM=lazy, MLA_GLUON_META_AHEAD=ahead)
           for pipe, lazy, ahead in [(2, True, False), (2, True, True), (0, True, True), (1, True, True)]]
#: Run 13: the default with and without the kept TMA descriptors
GLUON_13 = [dict(MLA_GLUON_DESC_CACHE=True), dict(MLA_GLUON_DESC_CACHE=False)]
#: Run 20: the one-stream kernel beside FlashMLA's seesaw (`mla_gluon_seesaw.py`, the default since), its worker at
#: 240 and 256 registers (run 20 also had the ping-pong kernel, since removed: 0.357 / 0.179 ms)
GLUON_20 = [dict(MLA_GLUON_SEESAW=False), dict(MLA_GLUON_SEESAW=True, MLA_GLUON_SEESAW_REGS=240),
            dict(MLA_GLUON_SEESAW=True, MLA_GLUON_SEESAW_REGS=256)]


@contextlib.contextmanager
def extra_consts(consts):
    """`mla_decode.kernel_consts` and the two switches after them (CONSTS)."""
    n = len(KERNEL_CONSTS)
    with kernel_consts(consts[:n]), mock.patch.object(mla_decode, "MLA_ONE_SLOT", consts[n]), \
            mock.patch.object(mla_decode, "MLA_Q_LOOP", consts[n + 1]):
        yield


class Launches:
    """Stands in for `mla_kernel.mla_kernel`: launches it and keeps the compiled kernel of the last launch."""

    def __init__(self, real):
        self.real, self.last = real, None

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.last = self.real[grid](*args, **kwargs)
            return self.last
        return launch


def compiled_facts(k) -> dict:
    out = {}
    for name in ("n_regs", "n_spills"):
        try:
            out[name] = int(getattr(k, name))
        except Exception as exc:  # reported, not hidden
            out[name] = f"{type(exc).__name__}"
    try:
        out["shared_bytes"] = int(k.metadata.shared)
        asm = k.asm
        out["wgmma"] = "wgmma" in asm.get("ptx", "")
        out["mma_sync"] = "mma.sync" in asm.get("ptx", "")
    except Exception as exc:  # reported, not hidden
        out["facts_error"] = f"{type(exc).__name__}: {exc}"[:200]
    return out


def op_table(step, rows=25) -> str:
    step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA], record_shapes=True) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    return prof.key_averages(group_by_input_shape=True).table(sort_by="self_cuda_time_total", row_limit=rows,
                                                               max_name_column_width=40, max_shapes_column_width=70)


def kernel_ms(step) -> float:
    """GPU time per step of the MLA kernel alone (`_mla_body` or the Gluon kernel; 3 profiled steps)."""
    step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    return sum(e.device_time_total for e in prof.key_averages()
               if "mla_body" in e.key or "mla_gluon" in e.key) / 3 / 1e3


def pieces(case, report):
    """The Gaudi route's pieces alone (module docstring)."""
    q, cache = case["q"], case["cache"]
    n = q.shape[0]
    batch = case["batch"]
    table, visible, _, masked, _ = mla_decode._layout(batch, q.device, True)  # (the route's layout)
    flat = cache.view(-1, L + 64)
    blocks = torch.tensor([row[: table.shape[1] // BS] for row in case["table"]], device="cuda")
    out = {"width": table.shape[1], "masked": masked}
    out["gather_slots_ms"] = timed(lambda: flat[table])
    out["gather_index_select_ms"] = timed(lambda: flat.index_select(0, table.view(-1)))
    out["gather_blocks_ms"] = timed(lambda: cache.index_select(0, blocks.view(-1)))
    kv = flat[table]
    s = torch.empty((n, H, kv.shape[1]), dtype=q.dtype, device="cuda")
    out["scores_ms"] = timed(lambda: s.baddbmm_(q, kv.transpose(1, 2), beta=0.0, alpha=SCALE))
    out["values_bmm_ms"] = timed(lambda: torch.bmm(s, kv[..., :L]))
    out["values_matmul_ms"] = timed(lambda: torch.matmul(s, kv[..., :L]))
    bias = torch.zeros((n, 1, 1, kv.shape[1]), dtype=q.dtype, device="cuda").masked_fill_(
        ~visible[:, None, None, :], float("-inf"))
    out["latent_attend_ms"] = timed(lambda: latent_attend(q, kv, bias if masked else None, L, SCALE))
    for chunk in (8, 16, 32):  # gathered latents of `chunk` requests: 4.7 MB each at 4096 keys (L2: 50 MB)
        def run(chunk=chunk):
            for r in range(0, n, chunk):
                latent_attend(q[r:r + chunk], flat[table[r:r + chunk]], bias[r:r + chunk] if masked else None, L,
                              SCALE)
        out[f"chunks_of_{chunk}_ms"] = timed(run)
    out["whole_gather_and_attend_ms"] = timed(lambda: latent_attend(q, flat[table], bias if masked else None, L,
                                                                    SCALE))
    report["pieces"] = out
    print("pieces", json.dumps(out), flush=True)


def host_ms(step, iters=20) -> float:
    """CPU time per step call (launches queued, no sync in between): what the host spends, which the step's
    wall-clock shows when it exceeds the GPU time."""
    import time

    step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        step()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / iters * 1e3


def launch_host_us(case, iters=300) -> dict:
    """Host microseconds per call of the kernel route's partial (`kernel_mla_partial`: slot order kept, buffers,
    the launch) with and without the kept TMA descriptors, and of building the descriptors alone (run 13)."""
    import time

    from vllm_gaudi_unified.mla import latent_views
    from vllm_gaudi_unified.paths import mla_gluon

    kc = latent_views(case["cache"], L)[0]
    out = {}
    for rnd in range(2):
        for keep in (False, True):
            with mock.patch.object(mla_decode, "MLA_GLUON_DESC_CACHE", keep):
                call = lambda: mla_decode.kernel_mla_partial(case["q"], kc, L, case["batch"], SCALE)  # noqa: E731
                call()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(iters):
                    call()
                out[f"partial_keep{int(keep)}_r{rnd}_us"] = (time.perf_counter() - t0) / iters * 1e6
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(iters):
                mla_gluon.cache_descriptors(kc, L, mla_decode.MLA_GLUON_KEYS, keep)
            out[f"descriptors_keep{int(keep)}_r{rnd}_us"] = (time.perf_counter() - t0) / iters * 1e6
    print("host", json.dumps(out), flush=True)
    return out


def gluon_kernels(case, report, flops, gluon_rows=GLUON, key="kernel"):
    """The shipped Triton kernel, then each Gluon variant (`GLUON`) on the same step (error, times, facts)."""
    from vllm_gaudi_unified.paths import mla_gluon, mla_gluon_seesaw

    rows = []
    variants = [("triton", {"MLA_GLUON": False})] + [("gluon", dict({"MLA_GLUON_SEESAW": False}, **v, MLA_GLUON=True))
                                                     for v in gluon_rows]  # (a row without the switch: one-stream)
    launches = {"triton": Launches(mla_kernel.mla_kernel), "gluon": Launches(mla_gluon.mla_gluon_kernel),
                "seesaw": Launches(mla_gluon_seesaw.mla_gluon_seesaw_kernel)}
    for kind, consts in variants:
        row = dict(kernel=kind, **consts)
        try:
            with contextlib.ExitStack() as stack:
                for k, v in consts.items():
                    stack.enter_context(mock.patch.object(mla_decode, k, v))
                stack.enter_context(mock.patch.object(mla_kernel, "mla_kernel", launches["triton"]))
                stack.enter_context(mock.patch.object(mla_gluon, "mla_gluon_kernel", launches["gluon"]))
                stack.enter_context(mock.patch.object(mla_gluon_seesaw, "mla_gluon_seesaw_kernel",
                                                      launches["seesaw"]))
                which = "seesaw" if consts.get("MLA_GLUON_SEESAW") else kind
                launches[which].last = None
                row["max_err"] = case["err"](case["run"]())
                if launches[which].last is None:
                    raise RuntimeError(f"the {which} kernel did not run")
                row.update(compiled_facts(launches[which].last))
                row["ms"] = timed(case["step"], iters=10)
                row["host_ms"] = host_ms(case["step"])
                row["kernel_ms"] = kernel_ms(case["step"])
                row["kernel_TFLOPs"] = flops / (row["kernel_ms"] * 1e-3) / 1e12
                row["x_floor"] = row["kernel_ms"] / report["case" if key == "kernel" else f"case_{key}"]["floor_ms"]
        except Exception as exc:  # reported, not hidden
            row["error"] = f"{type(exc).__name__}: {exc}"[:400]
        rows.append(row)
        print(key, json.dumps(row), flush=True)
        report[key] = rows
    return rows


def kernels(case, report, flops, best_path=None):
    rows = []
    launches = Launches(mla_kernel.mla_kernel)
    for consts in KERNELS:
        consts = (*consts, False) if len(consts) == len(CONSTS) - 1 else consts
        row = dict(zip(CONSTS, consts))
        try:
            with extra_consts(consts), mock.patch.object(mla_kernel, "mla_kernel", launches):
                row["max_err"] = case["err"](case["run"]())
                row.update(compiled_facts(launches.last))
                row["ms"] = timed(case["step"], iters=10)
                row["kernel_ms"] = kernel_ms(case["step"])
                row["kernel_TFLOPs"] = flops / (row["kernel_ms"] * 1e-3) / 1e12
        except Exception as exc:  # reported, not hidden
            row["error"] = f"{type(exc).__name__}: {exc}"[:400]
        rows.append(row)
        print("kernel", json.dumps(row), flush=True)
        report["kernel"] = rows
        ok = [r for r in rows if "ms" in r and r["max_err"] < 1e-2]
        best = min(ok, key=lambda r: r["ms"]) if ok else None  # (the whole step: splits cost a fold after)
        if best and best_path:  # as it goes: a run cut short keeps the best so far
            with open(best_path, "w") as f:
                json.dump({k: best[k] for k in CONSTS}, f)
    return best


def main() -> None:
    parser = Parser(description=__doc__)
    parser.add_argument("--out", type=output_path, required=True)
    parser.add_argument("--best", help="write the fastest correct constants here (JSON, for mla_decode --consts)")
    parser.add_argument("--kernels-only", action="store_true", help="the kernel's sweep alone (no Gaudi route parts)")
    parser.add_argument("--once", help="constants (JSON, as --best writes): three steps of the CUDA route, nothing "
                                       "else (for a profiler)")
    parser.add_argument("--once-shared", action="store_true",
                        help="--once on the shared step (64 x (4096 shared + 256)) instead of 128 x 4096")
    parser.add_argument("--gluon", action="store_true", help="the shipped Triton kernel and the Gluon variants only")
    parser.add_argument("--gluon-rows", default="GLUON",
                        choices=["GLUON", "GLUON_C", "GLUON_13", "GLUON_20"],
                        help="which list of Gluon variants --gluon runs")
    parser.add_argument("--gluon-shared", action="store_true",
                        help="--gluon also on the shared step (64 x (4096 shared + 256)); its floor: the larger of "
                             "the HBM and the compute floor")
    args = parser.parse_args()
    if args.once:
        with open(args.once) as f:
            consts = json.load(f)
        case = (setup("shared_64x4k+256", [4096 + 256] * 64, 4096 // BS) if args.once_shared
                else setup("decode_128x4k", [4096] * 128, 0))
        with contextlib.ExitStack() as stack:  # (any of paths/mla_decode.py's constants: the Gluon kernel's too)
            for k, v in consts.items():
                if not hasattr(mla_decode, k):
                    raise ValueError(f"--once: paths/mla_decode.py has no constant {k}")
                stack.enter_context(mock.patch.object(mla_decode, k, v))
            for _ in range(3):
                case["step"]()
        torch.cuda.synchronize()
        return
    rates = read_bandwidth(), matmul_rate()
    report = {"device": torch.cuda.get_device_name(), "read_bandwidth_GBps": rates[0] / 1e9,
              "matmul_TFLOPs": rates[1] / 1e12}
    print(report, flush=True)
    case = setup("decode_128x4k", [4096] * 128, 0)
    entry = case["entry"]
    entry["floor_ms"] = entry["latent_bytes_read_once"] / rates[0] * 1e3
    report["case"] = entry

    def save():
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)

    if args.gluon:
        if args.gluon_rows == "GLUON_13":
            report["host"] = launch_host_us(case)
        gluon_kernels(case, report, entry["attention_flops"], globals()[args.gluon_rows])
        save()
        if args.gluon_shared:
            del case
            torch.cuda.empty_cache()
            shared = setup("shared_64x4k+256", [4096 + 256] * 64, 4096 // BS)
            e = shared["entry"]
            e["floor_ms"] = max(e["latent_bytes_read_once"] / rates[0], e["attention_flops"] / rates[1]) * 1e3
            report["case_shared"] = e
            gluon_kernels(shared, report, e["attention_flops"], globals()[args.gluon_rows], key="shared")
            save()
        return
    best = kernels(case, report, entry["attention_flops"], args.best)
    save()
    if args.kernels_only:
        return
    try:
        with fused.gaudi_route():
            report["gaudi_ms"] = timed(case["step"])
            report["gaudi_max_err"] = case["err"](case["run"]())
            report["gaudi_ops"] = op_table(case["step"])
        print("gaudi", report["gaudi_ms"], report["gaudi_max_err"], "\n" + report["gaudi_ops"], flush=True)
    except Exception as exc:  # reported, not hidden; the other parts still run
        report["gaudi_error"] = f"{type(exc).__name__}: {exc}"[:400]
        print(report["gaudi_error"], flush=True)
    save()
    try:
        pieces(case, report)
    except Exception as exc:
        report["pieces_error"] = f"{type(exc).__name__}: {exc}"[:400]
        print(report["pieces_error"], flush=True)
    save()
    if best:
        consts = tuple(best[k] for k in CONSTS)
        try:
            with extra_consts(consts):
                report["cuda_best"] = best
                report["cuda_ops"] = op_table(case["step"])
            print("cuda best", json.dumps(best), "\n" + report["cuda_ops"], flush=True)
        except Exception as exc:
            report["cuda_ops_error"] = f"{type(exc).__name__}: {exc}"[:400]
    save()


if __name__ == "__main__":
    main()
