#!/bin/bash
# Kernel run 20 (one call): FlashMLA's seesaw schedule in Gluon (mla_gluon_seesaw.py, MLA_GLUON_SEESAW): its CUDA
# cases, then the probe's run-20 rows (the default, the ping-pong, the seesaw at 240 and 256 registers) on
# 128 x 4096 and the shared step, kernel ms from the profiler.
export PYTHONUNBUFFERED=1
R=$OUT/r20; mkdir -p $R
timeout 170 python3 -m pytest -q -s -p no:cacheprovider tests/test_mla_decode.py -k "seesaw" > $R/pytest.txt 2>&1; echo "pytest $?"; tail -2 $R/pytest.txt
grep "max err" $R/pytest.txt | awk '{print $NF}' | sort -g | tail -1; grep -m3 -B2 -A12 "Error" $R/pytest.txt | head -40
timeout 200 python3 -m benchmarks.mla_decode_probe --gluon --gluon-rows GLUON_20 --gluon-shared --out $R/probe.json > $R/probe_log.txt 2>&1; echo "probe $?"
python3 - "$R" <<'PY'
import json, sys
for l in open(f"{sys.argv[1]}/probe_log.txt"):
    key = l.split(" ", 1)[0]
    if key in ("kernel", "shared"):
        r = json.loads(l[len(key) + 1:])
        keep = ("kernel", "MLA_GLUON_PP", "MLA_GLUON_SEESAW", "MLA_GLUON_SEESAW_REGS", "kernel_ms", "x_floor",
                "n_regs", "n_spills", "max_err", "error")
        print(key, {x: (round(r[x], 4) if isinstance(r.get(x), float) else r.get(x)) for x in keep if x in r})
    elif l.startswith("{'device"):
        print(l.strip()[:300])
PY
tar -czf $OUT/r20.tgz -C $OUT r20 && rm -rf $R
