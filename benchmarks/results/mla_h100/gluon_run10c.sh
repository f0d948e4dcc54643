#!/bin/bash
# Kernel run 10, third call: the CUDA tests with the Gluon kernel as the default on sm_90, the probe's rows
# (Triton; Gluon PIPE 2 + LAZY_SUM with and without META_AHEAD, ...), the routes with the new default beside
# cuda_triton, Nsight Compute on the default; then the warp-specialised kernel (mla_gluon_ws.py) last: its
# probe rows, its tests and its Nsight Compute summary (a hang there stops nothing before it).
O=$OUT; P=${1:-gluon_run10c}
export PYTHONUNBUFFERED=1
(nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader; python3 -c "import torch,triton;print(torch.__version__, triton.__version__)") > $O/${P}_pytest.txt 2>&1
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_mla_decode.py -k "(gluon or cuda) and not ws" >> $O/${P}_pytest.txt 2>&1; echo pytest $?; tail -2 $O/${P}_pytest.txt
timeout 150 python3 -m benchmarks.mla_decode_probe --gluon --gluon-rows GLUON_C --out $O/${P}_probe.json > $O/${P}_probe_log.txt 2>&1; echo probe $?
C=decode_128x4k,unshared_64x4352,shared_64x4k+256
timeout 150 python3 -m benchmarks.mla_decode --skip-prompt --skip-vllm-gaudi --profile --cases $C --out $O/${P}_routes.json > $O/${P}_routes_log.txt 2>&1; echo routes $?
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
echo '{}' > /tmp/d.json; echo '{"MLA_GLUON_WS": true}' > /tmp/w.json
timeout 60 $NCU --clock-control none -k regex:"mla_gluon" -c 1 --section SpeedOfLight --section WarpStateStats --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis --section SchedulerStats python3 -m benchmarks.mla_decode_probe --out /dev/null --once /tmp/d.json > $O/${P}_ncu.txt 2>&1; echo ncu default $?
timeout 80 python3 -m benchmarks.mla_decode_probe --gluon --gluon-rows GLUON_WS --out $O/${P}_ws_probe.json > $O/${P}_ws_log.txt 2>&1; echo ws probe $?
timeout 80 python3 -m pytest -q -p no:cacheprovider tests/test_mla_decode.py -k "ws" >> $O/${P}_ws_log.txt 2>&1; echo ws pytest $?; tail -2 $O/${P}_ws_log.txt
timeout 45 $NCU --clock-control none -k regex:"mla_gluon" -c 1 --section SpeedOfLight --section WarpStateStats --section SchedulerStats python3 -m benchmarks.mla_decode_probe --out /dev/null --once /tmp/w.json >> $O/${P}_ncu.txt 2>&1; echo ncu ws $?
python3 - "$O" "$P" <<'PY'
import json, sys
O, P = sys.argv[1:]
for f in (f"{O}/{P}_probe_log.txt", f"{O}/{P}_ws_log.txt"):
    for l in open(f):
        if l.startswith("kernel "):
            r = json.loads(l[7:])
            keep = ("kernel", "MLA_GLUON_PIPE", "MLA_GLUON_LAZY_SUM", "MLA_GLUON_META_AHEAD", "MLA_GLUON_WS", "MLA_GLUON_WS_REGS",
                    "MLA_SPLIT_KEYS", "kernel_ms", "x_floor", "ms", "host_ms", "n_regs", "n_spills", "max_err", "error")
            print({x: (round(r[x], 4) if isinstance(r.get(x), float) else r.get(x)) for x in keep if x in r})
        elif l.startswith("{'device"):
            print(l.strip()[:200])
try:
    r = json.load(open(f"{O}/{P}_routes.json"))
    print(r.get("kernel_consts"))
    for c in r:
        if isinstance(r[c], dict) and "floor_ms" in r[c]:
            e = r[c]
            print(c, {k: round(v, 4) for k, v in e.items() if isinstance(v, float) and k.split("_ms")[0].split("_max_err")[0]
                      in ("cuda", "cuda_triton", "cuda_gluon", "floor", "compute_floor")}, e.get("cuda_error", ""))
except Exception as e:
    print("routes", e)
PY
grep -h "mla_gluon\|_mla_body\|Self CUDA time total" $O/${P}_routes_log.txt | grep -v "^ *$" | head -16 | cut -c1-60,160-200
grep -h "mla_gluon\|Duration\|DRAM Throughput\|L2 Cache Throughput\|Compute (SM) Throughput\|No Eligible\|Registers" $O/${P}_ncu.txt | cut -c1-120 | head -20
