#!/bin/bash
# Kernel run 16 (one call): the MLA kernels' CUDA tests with the rows normalized in the kernel (FINAL, the step's
# only path); the decode and shared steps' GPU time per step (mla_decode --profile, CUDA route); Nsight Compute's
# source-level stall sampling of the default Gluon kernel at 128 x 4096 (where its warps wait, per SASS line).
export PYTHONUNBUFFERED=1
R=$OUT/r16; mkdir -p $R
(nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader; ncu --version | tail -1) > $R/gpu.txt 2>&1
timeout 120 python3 -m benchmarks.mla_decode --skip-prompt --skip-vllm-gaudi --profile --cases decode_128x4k,shared_64x4k+256 --out $R/mla.json > $R/mla.log 2>&1; echo "mla rc $?"
grep -B1 -A7 "cuda_profile" $R/mla.log | grep -v "^---\|CPU total" | cut -c1-60,100-160
echo '{}' > $R/default.json
timeout 150 ncu -o $R/src --section SourceCounters --section WarpStateStats --section SpeedOfLight -k regex:mla_gluon_kernel -c 1 python3 -m benchmarks.mla_decode_probe --out /dev/null --once $R/default.json > $R/ncu_log.txt 2>&1; echo "ncu $?"
timeout 60 ncu --import $R/src.ncu-rep --page source --csv --print-source sass > $R/src.csv 2>$R/src_err.txt; echo "src $? $(wc -l < $R/src.csv)"
timeout 30 ncu --import $R/src.ncu-rep --page details > $R/details.txt 2>&1; grep -E "Duration|Warp Cycles Per Issued|Tensor|Stall" $R/details.txt | head -12
timeout 260 python3 -m pytest -q -p no:cacheprovider tests/test_mla_decode.py tests/test_mla_shared.py > $R/pytest.txt 2>&1; echo "pytest $?"; tail -3 $R/pytest.txt
gzip -f $R/src.csv; rm -f $R/src.ncu-rep.bak
tar -czf $OUT/r16.tgz -C $OUT r16 && rm -rf $R; ls -la $OUT
