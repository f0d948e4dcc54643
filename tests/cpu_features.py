"""The CPU features vLLM's CPU build looks for, and a switch to run the tests as on a CPU without them.

vLLM's CPU build decides from torch's probes (`torch.cpu._is_avx512_supported`,
`_is_avx512_bf16_supported`, `_is_amx_tile_supported`) which kernel library it loads
(`vllm._C` needs AVX-512 with BF16, `vllm._C_AVX512` AVX-512, `vllm._C_AVX2` AVX2) and
whether its CPU attention takes an fp8 KV cache (AVX-512 or AMX). Which CPU runs the tests
is not ours to choose, so the suite reads the same probes: a comparison whose reference
engine cannot run here skips, naming the missing feature, and still checks the plugin's
side against a reference that does run.

`UNIFIED_TEST_CPU=avx2` makes those probes answer False in the test process and, through the
environment, in every engine subprocess (`force_from_env` runs before vLLM is imported):
vLLM then takes the branches it takes on an AVX2-only CPU (the AVX2 kernel library, no fp8
cache). The instructions that run are still this machine's, so this tests the choices the
suite and the Gaudi harness make, not the absence of an instruction; a real AVX2-only CPU
(or an emulator) is the check of the latter.
"""
from __future__ import annotations

import os

FORCE_ENV = "UNIFIED_TEST_CPU"
FORCED_AVX2 = "avx2"

#: torch probe -> the feature's name as printed.
PROBES = {"_is_avx2_supported": "AVX2", "_is_avx512_supported": "AVX-512",
          "_is_avx512_bf16_supported": "AVX-512 BF16", "_is_amx_tile_supported": "AMX"}
#: The probes that answer False under UNIFIED_TEST_CPU=avx2.
ABOVE_AVX2 = ("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_amx_tile_supported",
              "_is_avx512_vnni_supported", "_is_amx_fp16_supported")


def forced() -> str | None:
    """The CPU level the tests are told to behave as (`UNIFIED_TEST_CPU`), or None."""
    value = os.environ.get(FORCE_ENV, "").strip().lower()
    if value in ("", "native"):
        return None
    if value != FORCED_AVX2:
        raise ValueError(f"{FORCE_ENV}={value!r}: expected {FORCED_AVX2!r} or 'native'")
    return value


def force_from_env() -> None:
    """Make torch's AVX-512 / AMX probes answer False in this process when `UNIFIED_TEST_CPU=avx2`
    (call before importing vLLM, which reads them at import and at engine start)."""
    if forced() is None:
        return
    # Inductor's compiled kernels follow the probes, but its on-disk cache does not key on them: a kernel
    # compiled natively (AVX-512) and reused by a run told it has AVX2 mixes the two and can crash. A cache
    # of its own per forced level (unless the caller chose one) keeps the runs apart.
    import getpass
    import tempfile

    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR",
                          os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}_{forced()}"))
    import torch

    for name in ABOVE_AVX2:
        if hasattr(torch.cpu, name):
            setattr(torch.cpu, name, lambda: False)


def features() -> dict[str, bool]:
    """Feature name -> present, as vLLM sees it (after `force_from_env`)."""
    import torch

    force_from_env()
    return {label: bool(getattr(torch.cpu, probe)()) for probe, label in PROBES.items()}


def describe() -> str:
    """One line for the test log: what the run saw."""
    seen = features()
    line = "CPU features as vLLM sees them: " + ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in seen.items())
    if forced():
        line += f" ({FORCE_ENV}={forced()}: AVX-512 and AMX hidden)"
    return line


def vllm_fp8_cpu_attention_missing() -> str | None:
    """Why vLLM's own CPU attention cannot run an fp8 KV cache on this CPU, or None when it can."""
    seen = features()
    if seen["AVX-512"] or seen["AMX"]:
        return None
    return ("vLLM's CPU attention needs AVX-512 or AMX for an fp8 KV cache, and this CPU has neither "
            "(NotImplementedError: FP8 KV cache on CPU requires x86 with AVX-512 or AMX)")


def vllm_kernel_library() -> str:
    """The kernel library vLLM's CPU platform loads on this CPU (`CpuPlatform.import_kernels`)."""
    seen = features()
    if seen["AVX-512"]:
        return "vllm._C" if seen["AVX-512 BF16"] else "vllm._C_AVX512"
    return "vllm._C_AVX2"


def loaded_vllm_libraries() -> list[str]:
    """vLLM's native kernel libraries mapped into this process (from /proc/self/maps), file names only."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "/vllm/_C" in line}
    except OSError:
        return []
    return sorted(os.path.basename(p) for p in paths)
