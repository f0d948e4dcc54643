"""The MLA kernel (`paths/mla_kernel.py`) compiled for an H100 without one: registers, spills, shared memory,
the matrix instructions used, and each loop's SASS instruction mix, per constant set.

Why: a device call is scarce; what a variant costs in registers and shared memory, whether it spills, whether
its products run on `wgmma`, and how many instructions a key tile issues are all decided by the compiler, so
they can be read here first and only the variants worth timing sent to the device (docs/benchmarks.md, MLA
runs 8 and 9). Use the device's Triton version (3.6 in this image's CUDA machines: e.g. `pip install
triton==3.6.0` into a side virtual environment; torch is not needed): Triton 3.9 compiles the same kernel
differently. The kernel is specialised as the benchmark's launch is (bf16, DeepSeek-V3's 128 heads, latent
512 + 64, block size 128, strides divisible by 16), or at the tests' shapes with `"small": true`.

`python benchmarks/mla_kernel_sass.py '{}' '{"KEYS": 32, "stages": 3}' ...`: one JSON object per variant, its
keys the kernel's constexpr parameters plus `warps` and `stages` (defaults: the shipped constants); prints the
facts and, per loop of more than 1000 instructions, its length and the counts of the instructions that matter
(HGMMA: `wgmma`; HMMA: `mma.sync`; LDGSTS: asynchronous copies; LDL/STL: spills; BAR: barriers).
"""
from __future__ import annotations

import collections
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

KERNEL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "vllm_gaudi_unified", "paths",
                      "mla_kernel.py")
#: The launch `paths/mla_decode.kernel_mla_partial` makes at DeepSeek-V3's shapes with the shipped constants.
DEEPSEEK = dict(HQ=128, BLOCK_H=64, DV=512, DV_PAD=512, DR=64, DR_PAD=64, BS=128, KEYS=64, SLICE=False, V_LOAD=0,
                ONE_SLOT=True, Q_LOOP=True, SELF=True, sc_s=576)
SMALL = dict(HQ=4, BLOCK_H=16, DV=16, DV_PAD=16, DR=8, DR_PAD=16, BS=16, KEYS=16, sc_s=24)  # tests/test_mla.py
TYPES = {"q_ptr": "*bf16", "k_ptr": "*bf16", "c_ptr": "*bf16", "acc_ptr": "*fp32", "m_ptr": "*fp32",
         "l_ptr": "*fp32", "scale": "fp32"}  # (other pointers: int64 tables; other scalars: int32)
COUNTED = ("HGMMA", "HMMA", "LDGSTS", "LDG", "LDL", "STL", "BAR", "MUFU", "SHFL", "FMUL", "IMAD", "ISETP")


def load_kernel(path: str = KERNEL):
    """The module's `mla_kernel` without importing the package (which needs torch)."""
    spec = importlib.util.spec_from_file_location("mla_kernel_sass_target", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.mla_kernel


def signature_of(kernel, consts: dict, types: dict) -> tuple[dict, dict]:
    """(signature, attrs) of a launch: `consts` as constexprs, pointers and scalars by `types` (other pointers
    int64 tables, other scalars int32), pointers and row strides divisible by 16 as the launcher specialises."""
    signature, attrs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in consts:
            signature[name] = "constexpr"
            continue
        signature[name] = types.get(name, "*i64" if name.endswith("_ptr") else "i32")
        if name.endswith("_ptr") or name.startswith(("sq_", "sk_", "sc_")):
            attrs[(i,)] = [["tt.divisibility", 16]]  # (what the launcher's arguments specialise to)
    return signature, attrs


def compile_variant(kernel, variant: dict):
    """Compiled for sm_90 as the benchmark launches it, with `variant`'s constants and warps / stages."""
    variant = dict(variant)
    warps, stages = variant.pop("warps", 8), variant.pop("stages", 2)
    consts = dict(DEEPSEEK, **(SMALL if variant.pop("small", False) else {}), **variant)
    for p in kernel.params:
        if p.is_constexpr and p.name not in consts:
            consts[p.name] = p.default
    signature, attrs = signature_of(kernel, consts, TYPES)
    src = ASTSource(fn=kernel, signature=signature, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})


def _tool(name: str) -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def facts(compiled) -> dict:
    """Shared memory, registers and stack (spills) per thread, and which matrix instructions the PTX holds."""
    ptx = compiled.asm["ptx"]
    out = {"shared_bytes": compiled.metadata.shared, "wgmma": "wgmma" in ptx, "mma_sync": "mma.sync" in ptx}
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])
        usage = subprocess.run([_tool("cuobjdump"), "-res-usage", path], capture_output=True, text=True).stdout
        sass = subprocess.run([_tool("cuobjdump"), "-sass", path], capture_output=True, text=True).stdout
    for key in ("REG", "STACK"):
        m = re.search(rf"\b{key}:(\d+)", usage)
        out[key.lower()] = int(m.group(1)) if m else None
    out["loops"] = loops(sass)
    return out


def loops(sass: str, min_len: int = 1000) -> list[dict]:
    """Each backward branch's body of at least `min_len` instructions: its length and COUNTED opcodes."""
    code = []
    for line in sass.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]+)\*/\s+(.*?);", line)
        if m:
            code.append((int(m.group(1), 16), re.sub(r"^@!?U?P\w+\s+", "", m.group(2)).split()[0].split(".")[0],
                         m.group(2)))
    out = []
    for address, _, text in code:
        m = re.search(r"BRA\s+(?:`\(\.L_x_\d+\)\s*)?0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) < address:
            body = [op for a, op, _ in code if int(m.group(1), 16) <= a <= address]
            if len(body) >= min_len:
                counts = collections.Counter(body)
                out.append({"instructions": len(body), **{k: counts[k] for k in COUNTED if counts[k]}})
    return out


def print_variants(compile_one, error_chars: int = 300) -> None:
    """Each command-line JSON variant (default `{}`) compiled by `compile_one(dict)` and its `facts` printed."""
    print("triton", triton.__version__)
    for arg in sys.argv[1:] or ["{}"]:
        try:
            print(arg, json.dumps(facts(compile_one(json.loads(arg)))), flush=True)
        except Exception as exc:  # reported, not hidden: the other variants still compile
            print(arg, "error:", f"{type(exc).__name__}: {exc}"[:error_chars], flush=True)


def main() -> None:
    kernel = load_kernel(os.environ.get("MLA_KERNEL_FILE", KERNEL))
    print_variants(lambda variant: compile_variant(kernel, variant))


if __name__ == "__main__":
    main()
