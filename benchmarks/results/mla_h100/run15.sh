#!/bin/bash
# Kernel run 15 (one call; carry .wt/peer .wt/old): the ping-pong Gluon kernel with its slot bounds and fetch rows
# loaded an iteration ahead (MLA_GLUON_PP_AHEAD) beside the default, on 128 x 4096 and the shared step (kernel ms
# from the profiler); its CUDA cases; the decode step's GPU time with normalize writing the query's dtype; the CPU
# finding of stop 32 (test_prompts' compiled split form under torch 2.11) on the tree before 93b899f and now.
export PYTHONUNBUFFERED=1 VLLM_GAUDI_TARBALL=$PWD/.wt/peer/vllm-gaudi-091bbadd.tar.gz
R=$OUT/r15; mkdir -p $R; P=run15
(nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader; python3 -c "import torch,triton;print(torch.__version__, triton.__version__)"; lscpu | grep -i "model name") > $R/gpu.txt 2>&1
timeout 150 python3 -m pytest -q -s -p no:cacheprovider tests/test_mla_decode.py -k "pp_on_hopper" > $R/pytest.txt 2>&1; echo "pytest $?"; tail -2 $R/pytest.txt
grep "max err" $R/pytest.txt | awk '{print $NF}' | sort -g | tail -1
timeout 170 python3 -m benchmarks.mla_decode_probe --gluon --gluon-rows GLUON_15 --gluon-shared --out $R/probe.json > $R/probe_log.txt 2>&1; echo "probe $?"
python3 - "$R" <<'PY'
import json, sys
R = sys.argv[1]
for l in open(f"{R}/probe_log.txt"):
    key = l.split(" ", 1)[0]
    if key in ("kernel", "shared"):
        r = json.loads(l[len(key) + 1:])
        keep = ("kernel", "MLA_GLUON_PP", "MLA_GLUON_PP_AHEAD", "MLA_GLUON_PP_REGS", "kernel_ms", "x_floor",
                "n_regs", "n_spills", "max_err", "error")
        print(key, {x: (round(r[x], 4) if isinstance(r.get(x), float) else r.get(x)) for x in keep if x in r})
    elif l.startswith("{'device"):
        print(l.strip()[:300])
PY
timeout 120 python3 -m benchmarks.mla_decode --skip-prompt --skip-vllm-gaudi --profile --cases decode_128x4k --out $R/mla.json > $R/mla.log 2>&1; echo "mla rc $?"
grep -A8 "decode_128x4k cuda_profile" $R/mla.log | cut -c1-60,100-175
for t in .wt/old .; do (cd $t && timeout 100 python3 -m pytest -q -p no:cacheprovider "tests/test_prompts.py::test_the_split_form_compiles_once_per_bucket_and_the_key_carries_the_form" > $R/cpu_$(basename $(realpath $t)).txt 2>&1; echo "cpu test in $t: $?"; tail -3 $R/cpu_$(basename $(realpath $t)).txt | cut -c1-300); done
tar -czf $OUT/r15.tar.gz -C $OUT r15
