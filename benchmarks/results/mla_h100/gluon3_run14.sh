#!/bin/bash
# Kernel run 14 (one call): the Gluon CUDA tests (the default kernel's cases and the ping-pong kernel without a
# producer, mla_gluon_pp.py, MLA_GLUON_PP), then the probe's run-14 rows on 128 x 4096 and on the shared step
# 64 x (4096 shared + 256): the Triton kernel, the default Gluon kernel and the ping-pong variants side by side in
# one process (kernel ms from the profiler, x floor, max err, registers), then Nsight Compute on the ping-pong kernel.
O=$OUT/r; mkdir -p $O; P=${1:-gluon3_run14}
export PYTHONUNBUFFERED=1
(nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader; python3 -c "import torch,triton;print(torch.__version__, triton.__version__)") > $O/${P}_pytest.txt 2>&1
timeout 170 python3 -m pytest -q -s -p no:cacheprovider tests/test_mla_decode.py -k "gluon and not ws" >> $O/${P}_pytest.txt 2>&1; echo pytest $?; tail -2 $O/${P}_pytest.txt
grep "max err" $O/${P}_pytest.txt | grep -c PP; grep "max err" $O/${P}_pytest.txt | grep PP | awk '{print $NF}' | sort -g | tail -1
timeout 200 python3 -m benchmarks.mla_decode_probe --gluon --gluon-rows GLUON_14 --gluon-shared --out $O/${P}_probe.json > $O/${P}_probe_log.txt 2>&1; echo probe $?
python3 - "$O" "$P" <<'PY'
import json, sys
O, P = sys.argv[1:]
for l in open(f"{O}/{P}_probe_log.txt"):
    key = l.split(" ", 1)[0]
    if key in ("kernel", "shared"):
        r = json.loads(l[len(key) + 1:])
        keep = ("kernel", "MLA_GLUON_PP", "MLA_GLUON_PP_REGS", "MLA_SPLIT_KEYS", "kernel_ms", "x_floor", "ms",
                "n_regs", "n_spills", "shared_bytes", "max_err", "error")
        print(key, {x: (round(r[x], 4) if isinstance(r.get(x), float) else r.get(x)) for x in keep if x in r})
    elif l.startswith("{'device"):
        print(l.strip()[:400])
try:
    r = json.load(open(f"{O}/{P}_probe.json"))
    for c in ("case", "case_shared"):
        print(c, {k: r[c][k] for k in ("floor_ms", "latent_bytes_read_once", "attention_flops") if k in r[c]})
except Exception as exc:
    print("probe json", exc)
PY
echo '{"MLA_GLUON_PP": true}' > $O/pp.json
timeout 80 ncu -k regex:mla_gluon_pp -c 1 --section SpeedOfLight --section WarpStateStats --section Occupancy python3 -m benchmarks.mla_decode_probe --out /dev/null --once $O/pp.json > $O/${P}_ncu.txt 2>&1; echo ncu $?
grep -E "Duration|DRAM Throughput|Compute \(SM\)|Memory Throughput|Registers|Stall|Warp Cycles|No Eligible" $O/${P}_ncu.txt | head -20
cd $OUT && tar czf ${P}.tgz r && rm -rf r; ls -la $OUT
