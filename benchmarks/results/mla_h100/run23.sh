#!/bin/bash
# Call 23: the splits merged in one pass (mla_kernel.split_combine), few decodes over long contexts (4 x 32k, 16 x 8k) with and without MLA_FILL_SMS (splits that fill the
# SMs once), 128 x 4096 beside (unchanged: its programs fill the SMs), GPU time per step from the profiler; the
# MLA CUDA tests.
export PYTHONUNBUFFERED=1
R=$OUT/r23; mkdir -p $R
timeout 240 python3 -m benchmarks.mla_decode --skip-prompt --skip-vllm-gaudi --profile \
  --cases decode_4x32k,decode_16x8k,decode_128x4k --out $R/mla.json > $R/mla.log 2>&1; echo "mla rc $?"
python3 - <<'PY'
import json, os, re
R = os.environ["OUT"] + "/r23"
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
    print("  errors", {k: v[:200] for k, v in e.items() if k.endswith("_error")})
PY
timeout 250 python3 -m pytest -q -p no:cacheprovider tests/test_mla_decode.py tests/test_mla_shared.py > $R/pytest.txt 2>&1; echo "pytest rc $?"; tail -3 $R/pytest.txt
tar -czf $OUT/r23.tar.gz -C $OUT r23
