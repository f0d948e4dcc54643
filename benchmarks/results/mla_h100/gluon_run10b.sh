#!/bin/bash
# Kernel run 10, second call: the Gluon kernel's variants (PIPE 0/1/2, LAZY_SUM) beside the Triton kernel, the
# CUDA tests, Nsight Compute on the Gluon kernel (base and PIPE 2 + LAZY_SUM) and on the Triton kernel.
O=$OUT; P=${1:-gluon_run10b}
export PYTHONUNBUFFERED=1
timeout 200 python3 -m pytest -q -x -p no:cacheprovider tests/test_mla_decode.py -k "gluon or cuda" > $O/${P}_pytest.txt 2>&1; echo pytest $?; tail -3 $O/${P}_pytest.txt
timeout 200 python3 -m benchmarks.mla_decode_probe --gluon --out $O/${P}_probe.json > $O/${P}_probe_log.txt 2>&1; echo probe $?
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
echo '{"MLA_GLUON": true}' > /tmp/g0.json
echo '{"MLA_GLUON": true, "MLA_GLUON_PIPE": 2, "MLA_GLUON_LAZY_SUM": true}' > /tmp/g2.json
echo '{"MLA_GLUON": false}' > /tmp/t.json
for w in g0 g2 t; do timeout 60 $NCU --clock-control none -k regex:"mla_gluon|mla_body" -c 1 --section SpeedOfLight --section WarpStateStats --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis --section SchedulerStats python3 -m benchmarks.mla_decode_probe --out /dev/null --once /tmp/$w.json > /tmp/ncu_$w.txt 2>&1; echo ncu $w $?; done
cat /tmp/ncu_g0.txt /tmp/ncu_g2.txt /tmp/ncu_t.txt > $O/${P}_ncu.txt
python3 - "$O" "$P" <<'PY'
import json, sys
O, P = sys.argv[1:]
for l in open(f"{O}/{P}_probe_log.txt"):
    if l.startswith("kernel "):
        r = json.loads(l[7:])
        keep = ("kernel", "MLA_GLUON_KEYS", "MLA_GLUON_STAGES", "MLA_GLUON_PIPE", "MLA_GLUON_LAZY_SUM", "MLA_SPLIT_KEYS",
                "kernel_ms", "x_floor", "ms", "host_ms", "n_regs", "n_spills", "max_err", "error")
        print({x: (round(r[x], 4) if isinstance(r.get(x), float) else r.get(x)) for x in keep if x in r})
    elif l.startswith("{"):
        print(l.strip()[:300])
PY
grep -h "mla_gluon_kernel\|_mla_body\|Duration\|Memory Throughput\|DRAM Throughput\|L2 Cache Throughput\|L1/TEX Cache Throughput\|Compute (SM) Throughput\|Issue Slots Busy\|Warp Cycles Per Issued\|No Eligible\|Shared Memory\|Executed Ipc A\|Stall\|One or More\|Bank" $O/${P}_ncu.txt | cut -c1-150 | head -60
