#!/bin/bash
# Call 19 (issue 26, the closing table; carry .wt/peer): MLA decode at DeepSeek-V3 shapes on both routes with
# vllm-gaudi's flat_pa_mla beside, GPU time per step from the profiler (the kernel's rows now final: FINAL); the
# MLA CUDA tests and the fused-path tests on the final tree.
export PYTHONUNBUFFERED=1 VLLM_GAUDI_TARBALL=$PWD/.wt/peer/vllm-gaudi-091bbadd.tar.gz
R=$OUT/r19; mkdir -p $R; git log -1 --format=%H > $R/commit.txt 2>/dev/null
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > $R/gpu.txt
timeout 300 python3 -m benchmarks.mla_decode --skip-prompt --profile \
  --cases decode_128x4k,shared_64x4k+256,unshared_64x4352 --out $R/mla.json > $R/mla.log 2>&1; echo "mla rc $?"
python3 - <<'PY'
import json, os, re
R = os.environ["OUT"] + "/r19"
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
timeout 220 python3 -m pytest -q -p no:cacheprovider tests/test_mla_chunks.py tests/test_mla_shared.py tests/test_fused.py tests/test_merge.py > $R/pytest.txt 2>&1; echo "pytest rc $?"; tail -3 $R/pytest.txt
tar -czf $OUT/r19.tar.gz -C $OUT r19
