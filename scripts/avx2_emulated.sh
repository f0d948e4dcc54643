#!/usr/bin/env bash
# The Gaudi path on a CPU without AVX-512, for real: vllm-gaudi's platform through the test stand-in,
# under user-mode QEMU emulating a Haswell (AVX2, no AVX-512, no AMX), against vLLM's CPU attention
# run natively. Not part of the test suite (it takes ~10 min on 2 cores); `UNIFIED_TEST_CPU=avx2` is the
# suite's fast stand-in for it. Needs Debian's qemu-user (apt-get install qemu-user) and the venv of
# scripts/test.sh with vllm-gaudi installed.
# Usage: bash scripts/avx2_emulated.sh [WORKDIR]
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${VENV:-.venv}/bin/python"
WORK="${1:-$(mktemp -d)}"
command -v qemu-x86_64 >/dev/null || { echo "qemu-x86_64 not found: apt-get install qemu-user" >&2; exit 2; }
export PYTHONPATH="$PWD:$PWD/tests"
EMULATE=(qemu-x86_64 -cpu Haswell)
echo "1. vLLM's default kernel library (what vllm-gaudi's platform imports) under the emulated CPU:"
if "${EMULATE[@]}" "$PY" -c "import torch, vllm._C" 2>/dev/null; then echo "   loaded"; else echo "   dies (exit $?)"; fi
"$PY" -c "import sys; sys.path.insert(0, 'tests'); import vllm_helpers as H; H.make_tiny_llama('$WORK/model', **H.MODELS['gqa'])" >/dev/null 2>&1
echo "2. the e2e scenario through the unified runner on vllm-gaudi's platform, emulated (minutes):"
VLLM_PLUGINS=unified_attention,01.hpu_custom_utils,02.hpu_custom_ops VLLM_GAUDI_UNIFIED=1 \
  "${EMULATE[@]}" "$PY" tests/vllm_helpers.py run --model "$WORK/model" --out "$WORK/unified.json" --gaudi-standin \
  >"$WORK/unified.log" 2>&1 || { echo "   failed: $WORK/unified.log"; exit 1; }
echo "3. vLLM's own CPU attention, native:"
"$PY" tests/vllm_helpers.py run --model "$WORK/model" --out "$WORK/ref.json" >"$WORK/ref.log" 2>&1
"$PY" - "$WORK" <<'EOF'
import json, sys
sys.path.insert(0, "tests")
import vllm_helpers as H
work = sys.argv[1]
got, ref = (json.load(open(f"{work}/{n}.json")) for n in ("unified", "ref"))
print("   kernel libraries: emulated", got["vllm_kernel_libraries"], "native", ref["vllm_kernel_libraries"])
random = {r["name"] for wave in H.scenario_prompts() for r in wave if r.get("n", 1) > 1}
for case, r in H.compare_results(got, ref).items():
    note = " (n > 1: vllm-gaudi draws its random numbers in its own order)" if case in random else ""
    print(f"   {case}: tokens identical {r['tokens_identical']}, max |dlogprob| {r['max_abs_logprob_diff']:.2e}{note}")
EOF
