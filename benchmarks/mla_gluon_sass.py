"""The Gluon MLA kernels (`paths/mla_gluon.py`, `paths/mla_gluon_seesaw.py`) compiled for an H100 without one:
registers, spills, shared memory and per-loop instruction mix, as `mla_kernel_sass.py` does for the Triton kernel.

Why: the device calls are few; a Gluon API error, a spill or a shared-memory overflow shows here first (run 10).
Use the device's Triton (3.6; Gluon's API differs between versions), no torch needed: the two modules are loaded
from their files without importing the package.

`python benchmarks/mla_gluon_sass.py '{}' '{"PIPE": 0}' '{"SEESAW": true, "REGS": 232}' ...`: one JSON object per
variant, its keys the kernel's constexpr parameters (`SEESAW`: FlashMLA's seesaw schedule,
`mla_gluon_seesaw.py`; `maxnreg`: the compile option); defaults: the shipped constants at DeepSeek-V3's launch
(bf16, 128 heads, 512 + 64, block size 128).
"""
from __future__ import annotations

import importlib.util
import os
import sys
import types

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mla_kernel_sass import print_variants, signature_of  # noqa: E402

PATHS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "vllm_gaudi_unified", "paths")
SHIPPED = dict(HQ=128, DV=512, DR=64, BS=128, KEYS=64, SLICE=False, SELF=True)
PLAIN = dict(STAGES=2, PIPE=2, LAZY_SUM=True, META_AHEAD=True, FINAL=False, num_warps=8)
SEESAW = dict(REGS=256, FINAL=False, num_warps=4)


def load():
    """(mla_gluon_kernel, mla_gluon_seesaw_kernel) from their files (the package's __init__ needs torch)."""
    for name in ("vllm_gaudi_unified", "vllm_gaudi_unified.paths"):
        sys.modules.setdefault(name, types.ModuleType(name))
    out = []
    for mod in ("mla_gluon", "mla_gluon_seesaw"):
        name = f"vllm_gaudi_unified.paths.{mod}"
        spec = importlib.util.spec_from_file_location(name, os.path.join(PATHS, f"{mod}.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        out.append(module)
    return out[0].mla_gluon_kernel, out[1].mla_gluon_seesaw_kernel


def compile_variant(kernels, variant: dict):
    variant = dict(variant)
    seesaw, maxnreg = variant.pop("SEESAW", False), variant.pop("maxnreg", None)
    kernel = kernels[1] if seesaw else kernels[0]
    consts = {**SHIPPED, **(SEESAW if seesaw else PLAIN), **variant}
    layout = lambda shape: repr(gl.NVMMASharedLayout.get_default_for(shape, gl.bfloat16))  # noqa: E731
    types_ = {"q_ptr": "*bf16", "k_ptr": "*bf16", "acc_ptr": "*bf16" if consts["FINAL"] else "*fp32",
              "m_ptr": "*fp32", "l_ptr": "*fp32",
              "scale": "fp32"}
    for name, cols in (("kn_desc", consts["DV"] // (2 if seesaw else 1)), ("kr_desc", consts["DR"])):
        types_[name] = f"tensordesc<bf16[{consts['KEYS']}, {cols}],{layout([consts['KEYS'], cols])}>"
    signature, attrs = signature_of(kernel, consts, types_)
    options = {"num_warps": consts["num_warps"], **({"maxnreg": maxnreg} if maxnreg else {})}
    src = GluonASTSource(fn=kernel, signature=signature, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def main() -> None:
    kernels = load()
    print_variants(lambda variant: compile_variant(kernels, variant), error_chars=600)


if __name__ == "__main__":
    main()
