#!/bin/bash
# Kernel run 13, first call: the Gluon CUDA tests (the shared cells through the Gluon kernel, MLA_GLUON_SHARED;
# the kept TMA descriptors; the warp-specialised kernel with a 1-warp producer), the routes on the shared and the
# 128 x 4096 step with the shared cells on the Gluon (cuda_gluon_shared) and on the Triton kernel
# (cuda_triton_shared) side by side, then the probe's run-13 rows (host time per launch with and without the kept
# descriptors; kernel times of the default, the WS kernel with its 4-warp and its 1-warp producer).
O=$OUT/r; mkdir -p $O; P=${1:-gluon2_run13a}
export PYTHONUNBUFFERED=1
(nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader; python3 -c "import torch,triton;print(torch.__version__, triton.__version__)") > $O/${P}_pytest.txt 2>&1
timeout 220 python3 -m pytest -q -s -p no:cacheprovider tests/test_mla_decode.py -k "gluon or cuda" >> $O/${P}_pytest.txt 2>&1; echo pytest $?; tail -2 $O/${P}_pytest.txt
grep -c "max err" $O/${P}_pytest.txt; grep "max err" $O/${P}_pytest.txt | awk '{print $NF}' | sort -g | tail -1
C=shared_64x4k+256,decode_128x4k
timeout 170 python3 -m benchmarks.mla_decode --skip-prompt --skip-vllm-gaudi --profile --cases $C --out $O/${P}_routes.json > $O/${P}_routes_log.txt 2>&1; echo routes $?
timeout 110 python3 -m benchmarks.mla_decode_probe --gluon --gluon-rows GLUON_13 --out $O/${P}_probe.json > $O/${P}_probe_log.txt 2>&1; echo probe $?
python3 - "$O" "$P" <<'PY'
import json, re, sys
O, P = sys.argv[1:]
for l in open(f"{O}/{P}_probe_log.txt"):
    if l.startswith("kernel "):
        r = json.loads(l[7:])
        keep = ("kernel", "MLA_GLUON_DESC_CACHE", "MLA_GLUON_WS", "MLA_GLUON_WS_PRODUCER_WARPS", "MLA_GLUON_WS_REGS",
                "kernel_ms", "x_floor", "ms", "host_ms", "n_regs", "n_spills", "shared_bytes", "max_err", "error")
        print({x: (round(r[x], 4) if isinstance(r.get(x), float) else r.get(x)) for x in keep if x in r})
    elif l.startswith(("host ", "{'device")):
        print(l.strip()[:400])
try:
    r = json.load(open(f"{O}/{P}_routes.json"))
    print(r.get("read_bandwidth_GBps"), r.get("matmul_TFLOPs"))
    for c in ("decode_128x4k", "shared_64x4k+256"):
        e = r[c]
        print(c, "floor", round(e["floor_ms"], 4), "compute", round(e["compute_floor_ms"], 4))
        for k in ("cuda", "cuda_triton", "cuda_gluon", "cuda_gluon_shared", "cuda_triton_shared", "cuda_shared_route"):
            if f"{k}_ms" not in e:
                continue
            prof = e.get(f"{k}_profile", "")
            kern = [ln for ln in prof.splitlines() if "mla_gluon" in ln or "mla_body" in ln or "_mla_kernel" in ln or "mla_kernel" in ln]
            tot = [ln for ln in prof.splitlines() if "Self CUDA time total" in ln]
            print(" ", k, "wall", round(e[f"{k}_ms"], 4), "err", round(e.get(f"{k}_max_err", -1), 4), "|",
                  [re.sub(r"\s+", " ", x)[:150] for x in kern[:2]], tot)
except Exception as exc:
    print("routes", exc)
PY
cd $OUT && tar czf ${P}.tgz r && rm -rf r; ls -la $OUT
