#!/bin/bash
# Call 21 (issue 26, the closing table, the seesaw kernel the default; carry .wt/peer): MLA decode at DeepSeek-V3
# shapes on both routes with vllm-gaudi's flat_pa_mla beside (GPU time per step from the profiler); the MLA CUDA
# tests; Nsight Compute's DRAM bytes of the seesaw kernel on the shared step (the prefix read once?).
export PYTHONUNBUFFERED=1 VLLM_GAUDI_TARBALL=$PWD/.wt/peer/vllm-gaudi-091bbadd.tar.gz
R=$OUT/r21; mkdir -p $R
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > $R/gpu.txt
timeout 300 python3 -m benchmarks.mla_decode --skip-prompt --profile \
  --cases decode_128x4k,shared_64x4k+256,unshared_64x4352 --out $R/mla.json > $R/mla.log 2>&1; echo "mla rc $?"
python3 - <<'PY'
import json, os, re
R = os.environ["OUT"] + "/r21"
rep = json.load(open(f"{R}/mla.json"))
for name, e in rep.items():
    if not isinstance(e, dict) or "floor_ms" not in e:
        continue
    gpu = {}
    for k, v in e.items():
        if k.endswith("_profile"):
            m = re.search(r"Self CUDA time total: ([0-9.]+)(ms|us)", v)
            if m:
                gpu[k[:-8]] = round(float(m.group(1)) / (1 if m.group(2) == "ms" else 1000) / 5, 4)
    print(name, "floor", round(e["floor_ms"], 4), "compute", round(e["compute_floor_ms"], 4))
    print("  wall", {k[:-3]: round(v, 3) for k, v in e.items() if k.endswith("_ms") and "floor" not in k})
    print("  err", {k[:-8]: round(v, 4) for k, v in e.items() if k.endswith("_max_err")})
    print("  gpu", gpu)
PY
echo '{}' > $R/default.json
for c in "" "--once-shared"; do timeout 60 ncu --metrics dram__bytes_read.sum,gpu__time_duration.sum -k regex:mla_gluon_seesaw -c 1 python3 -m benchmarks.mla_decode_probe --out /dev/null --once $R/default.json $c > $R/ncu$c.txt 2>&1; echo "ncu$c $?"; grep -E "dram__bytes_read.sum|gpu__time_duration" $R/ncu$c.txt; done
timeout 260 python3 -m pytest -q -p no:cacheprovider tests/test_mla_decode.py tests/test_mla_shared.py > $R/pytest.txt 2>&1; echo "pytest rc $?"; tail -3 $R/pytest.txt
tar -czf $OUT/r21.tar.gz -C $OUT r21
