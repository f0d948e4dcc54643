#!/bin/bash
# Kernel run 18 (one call): the ping-pong kernel fetching each half of a tile in pieces (MLA_GLUON_PP_PIECES 2, 4)
# beside the default and the ping-pong in whole halves, on 128 x 4096 and the shared step; the pieces' CUDA cases.
export PYTHONUNBUFFERED=1
R=$OUT/r18; mkdir -p $R
timeout 170 python3 -m benchmarks.mla_decode_probe --gluon --gluon-rows GLUON_18 --gluon-shared --out $R/probe.json > $R/probe_log.txt 2>&1; echo "probe $?"
python3 - "$R" <<'PY'
import json, sys
for l in open(f"{sys.argv[1]}/probe_log.txt"):
    key = l.split(" ", 1)[0]
    if key in ("kernel", "shared"):
        r = json.loads(l[len(key) + 1:])
        keep = ("kernel", "MLA_GLUON_PP", "MLA_GLUON_PP_PIECES", "kernel_ms", "x_floor", "n_regs", "n_spills",
                "max_err", "error")
        print(key, {x: (round(r[x], 4) if isinstance(r.get(x), float) else r.get(x)) for x in keep if x in r})
    elif l.startswith("{'device"):
        print(l.strip()[:300])
PY
timeout 200 python3 -m pytest -q -s -p no:cacheprovider tests/test_mla_decode.py -k "pp_on_hopper" > $R/pytest.txt 2>&1; echo "pytest $?"; tail -2 $R/pytest.txt
grep "max err" $R/pytest.txt | awk '{print $NF}' | sort -g | tail -1
tar -czf $OUT/r18.tgz -C $OUT r18 && rm -rf $R
