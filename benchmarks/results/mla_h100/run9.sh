#!/bin/bash
# run 9 on the device: sweep, routes after and before, CUDA tests, ncu of the baseline and the best
set -x
O=$OUT; T=$PWD
(nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader; python3 -c "import torch,triton;print(torch.__version__, triton.__version__)") > $O/run9_gpu.txt
python3 -c "import json; json.dump(dict(MLA_BLOCK_H=64, MLA_KEYS=64, MLA_WARPS=8, MLA_STAGES=2, MLA_SPLIT_KEYS=16384, MLA_V_LOAD=0, MLA_ONE_SLOT=True, MLA_Q_LOOP=True, MLA_TRANS=False, MLA_LAZY_SUM=False, MLA_ACC_DOT=False, MLA_FULL_FIRST=False), open('$O/run9_base.json','w'))"
timeout 200 python3 -m benchmarks.mla_decode_probe --kernels-only --out $O/run9_probe.json --best $O/run9_best.json > $O/run9_probe_log.txt 2>&1; echo probe $?
cat $O/run9_best.json
C=decode_128x4k,unshared_64x4352,shared_64x4k+256
timeout 70 python3 -m benchmarks.mla_decode --skip-prompt --skip-vllm-gaudi --profile --cases $C --consts $O/run9_best.json --out $O/run9_routes.json > $O/run9_log.txt 2>&1; echo after $?
(cd ../mlakern_before && timeout 70 python3 -m benchmarks.mla_decode --skip-prompt --skip-vllm-gaudi --profile --cases $C --out $O/run9_before.json > $O/run9_before_log.txt 2>&1; echo before $?)
timeout 80 python3 -m pytest -q -p no:cacheprovider tests/test_mla_decode.py > $O/run9_pytest.txt 2>&1; echo pytest $?; tail -2 $O/run9_pytest.txt
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
for w in base best; do timeout 60 $NCU --clock-control none -k regex:mla_body -c 1 --section SpeedOfLight --section WarpStateStats --section Occupancy --section SchedulerStats --section LaunchStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis python3 -m benchmarks.mla_decode_probe --out /dev/null --once $O/run9_$w.json > $O/run9_ncu_$w.txt 2>&1; echo ncu $w $?; done
python3 - <<'PY'
import json, os
O = os.environ["OUT"]
for l in open(f"{O}/run9_probe_log.txt"):
    if l.startswith("kernel "):
        r = json.loads(l[7:])
        k = [r.get(x) for x in ("MLA_BLOCK_H", "MLA_KEYS", "MLA_WARPS", "MLA_STAGES", "MLA_SPLIT_KEYS", "MLA_Q_LOOP", "MLA_TRANS", "MLA_LAZY_SUM", "MLA_ACC_DOT", "MLA_FULL_FIRST")]
        print(k, {x: (round(r[x], 4) if isinstance(r.get(x), float) else r.get(x)) for x in ("kernel_ms", "ms", "kernel_TFLOPs", "n_regs", "n_spills", "shared_bytes", "max_err", "error") if x in r})
for f in ("run9_routes.json", "run9_before.json"):
    try:
        r = json.load(open(f"{O}/{f}"))
        print(f, {c: {k: round(v, 4) for k, v in r[c].items() if k in ("cuda_ms", "cuda_max_err", "floor_ms", "cuda_over_max_floor")} for c in r if isinstance(r[c], dict) and "cuda_ms" in r[c]})
    except Exception as e:
        print(f, e)
PY
grep -h "Duration\|Issue Slots Busy\|Warp Cycles Per Issued\|Achieved Occupancy\|Registers Per\|Stall\|No Eligible\|Memory Throughput\|Compute (SM) Throughput\|Block Limit" $O/run9_ncu_base.txt $O/run9_ncu_best.txt | head -40
