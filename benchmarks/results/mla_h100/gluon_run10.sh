#!/bin/bash
# Kernel run 10 on the device (H100): the Gluon kernel (paths/mla_gluon.py) beside the Triton kernel.
# CUDA tests first (a kernel that hangs or is wrong stops nothing else: each step has its timeout), then the
# probe's kernel part (the shipped Triton constants and the Gluon variants on 128 x 4096), then the routes
# (cuda = the default, cuda_triton, cuda_gluon) with the profiler on the three scenarios.
O=$OUT; P=${1:-gluon_run10}
export PYTHONUNBUFFERED=1
(nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader; python3 -c "import torch,triton;print(torch.__version__, triton.__version__)") > $O/${P}_gpu.txt 2>&1
timeout 200 python3 -m pytest -q -x -p no:cacheprovider tests/test_mla_decode.py -k "gluon or cuda" > $O/${P}_pytest.txt 2>&1; echo pytest $?; tail -3 $O/${P}_pytest.txt
timeout 150 python3 -m benchmarks.mla_decode_probe --gluon --out $O/${P}_probe.json > $O/${P}_probe_log.txt 2>&1; echo probe $?
C=decode_128x4k,unshared_64x4352,shared_64x4k+256
timeout 120 python3 -m benchmarks.mla_decode --skip-prompt --skip-vllm-gaudi --profile --cases $C --out $O/${P}_routes.json > $O/${P}_routes_log.txt 2>&1; echo routes $?
python3 - "$O" "$P" <<'PY'
import json, sys
O, P = sys.argv[1:]
print(open(f"{O}/{P}_gpu.txt").read().strip())
for l in open(f"{O}/{P}_probe_log.txt"):
    if l.startswith("kernel "):
        r = json.loads(l[7:])
        keep = ("kernel", "MLA_GLUON_KEYS", "MLA_GLUON_STAGES", "MLA_GLUON_PIPE", "MLA_SPLIT_KEYS", "kernel_ms", "x_floor",
                "ms", "kernel_TFLOPs", "n_regs", "n_spills", "shared_bytes", "max_err", "error")
        print({x: (round(r[x], 4) if isinstance(r.get(x), float) else r.get(x)) for x in keep if x in r})
    elif l.startswith("{"):
        print(l.strip()[:300])
try:
    r = json.load(open(f"{O}/{P}_routes.json"))
    for c in r:
        if isinstance(r[c], dict) and "floor_ms" in r[c]:
            e = r[c]
            print(c, {k: round(v, 4) for k, v in e.items() if isinstance(v, float) and k.split("_ms")[0].split("_max_err")[0]
                      in ("cuda", "cuda_triton", "cuda_gluon", "floor", "compute_floor")}, e.get("cuda_gluon_error", ""))
except Exception as e:
    print("routes", e)
PY
for f in $O/${P}_routes_log.txt; do grep -A 16 "cuda_triton_profile\|cuda_gluon_profile" $f | grep -i "mla\|Self CUDA time total" | head -12; done
