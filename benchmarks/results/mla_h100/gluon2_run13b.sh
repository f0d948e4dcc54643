#!/bin/bash
# Kernel run 13, second call, with the shared cells on the Gluon kernel by default (MLA_GLUON_SHARED) and the kept
# TMA descriptors: the MLA CUDA tests (test_mla_decode.py, test_mla_shared.py), the routes on the three steps, and
# Nsight Compute's HBM bytes of the shared step's kernel, Gluon (the default) against Triton.
O=$OUT/r; mkdir -p $O; P=${1:-gluon2_run13b}
export PYTHONUNBUFFERED=1
(nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader; python3 -c "import torch,triton;print(torch.__version__, triton.__version__)") > $O/${P}_pytest.txt 2>&1
timeout 270 python3 -m pytest -q -s -p no:cacheprovider tests/test_mla_decode.py tests/test_mla_shared.py >> $O/${P}_pytest.txt 2>&1; echo pytest $?; tail -2 $O/${P}_pytest.txt
grep -c "max err" $O/${P}_pytest.txt; grep "max err" $O/${P}_pytest.txt | awk '{print $NF}' | sort -g | tail -1
C=decode_128x4k,shared_64x4k+256,unshared_64x4352
timeout 150 python3 -m benchmarks.mla_decode --skip-prompt --skip-vllm-gaudi --profile --cases $C --out $O/${P}_routes.json > $O/${P}_routes_log.txt 2>&1; echo routes $?
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
echo '{}' > /tmp/g.json; echo '{"MLA_GLUON_SHARED": false}' > /tmp/t.json
for v in g t; do
timeout 60 $NCU --clock-control none -k regex:"mla_gluon|mla_body" -c 1 --metrics dram__bytes_read.sum,gpu__time_duration.sum,lts__t_sector_hit_rate.pct python3 -m benchmarks.mla_decode_probe --out /dev/null --once /tmp/$v.json --once-shared > $O/${P}_ncu_$v.txt 2>&1; echo ncu $v $?
grep -h "mla_gluon\|_mla_body\|dram__bytes\|gpu__time\|lts__t" $O/${P}_ncu_$v.txt | cut -c1-110
done
timeout 60 $NCU --clock-control none -k regex:"mla_gluon" -c 1 --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,gpu__time_duration.sum" python3 -m benchmarks.mla_decode_probe --out /dev/null --once /tmp/g.json > $O/${P}_ncu_stalls.txt 2>&1; echo ncu stalls $?
grep -h "stalled\|hmma\|gpu__time" $O/${P}_ncu_stalls.txt | awk '$NF+0 > 0.05 || /hmma|gpu__time/' | sed 's/smsp__average_warps_issue_stalled_//; s/_per_issue_active.ratio//' | cut -c1-100
python3 - "$O" "$P" <<'PY'
import json, re, sys
O, P = sys.argv[1:]
try:
    r = json.load(open(f"{O}/{P}_routes.json"))
    print(r.get("read_bandwidth_GBps"), r.get("matmul_TFLOPs"), r.get("kernel_consts"))
    for c in ("decode_128x4k", "shared_64x4k+256", "unshared_64x4352"):
        e = r[c]
        print(c, "floor", round(e["floor_ms"], 4), "compute", round(e["compute_floor_ms"], 4))
        for k in ("cuda", "cuda_triton", "cuda_gluon", "cuda_gluon_shared", "cuda_triton_shared", "cuda_shared_route", "gaudi"):
            if f"{k}_ms" not in e:
                continue
            prof = e.get(f"{k}_profile", "")
            kern = [ln for ln in prof.splitlines() if "mla_gluon" in ln or "mla_body" in ln]
            tot = [ln for ln in prof.splitlines() if "Self CUDA time total" in ln]
            print(" ", k, "wall", round(e[f"{k}_ms"], 4), "err", round(e.get(f"{k}_max_err", -1), 4), "|",
                  [re.sub(r"\s+", " ", x)[:150] for x in kern[:2]], tot)
except Exception as exc:
    print("routes", exc)
PY
cd $OUT && tar czf ${P}.tgz r && rm -rf r; ls -la $OUT
