#!/bin/bash
# Kernel run 17 (one call): the MLA CUDA tests after the ping-pong kernel's FINAL fix; Nsight Compute's
# source-level stall sampling of the ping-pong kernel (MLA_GLUON_PP, slot metadata ahead) at 128 x 4096.
export PYTHONUNBUFFERED=1
R=$OUT/r17; mkdir -p $R
echo '{"MLA_GLUON_PP": true}' > $R/pp.json
timeout 150 ncu -o $R/src --section SourceCounters --section WarpStateStats --section SpeedOfLight -k regex:mla_gluon_pp -c 1 python3 -m benchmarks.mla_decode_probe --out /dev/null --once $R/pp.json > $R/ncu_log.txt 2>&1; echo "ncu $?"
timeout 60 ncu --import $R/src.ncu-rep --page source --csv --print-source sass > $R/src.csv 2>$R/src_err.txt; echo "src $? $(wc -l < $R/src.csv)"
timeout 30 ncu --import $R/src.ncu-rep --page details > $R/details.txt 2>&1; grep -E "Duration|Warp Cycles Per Issued" $R/details.txt | head -4
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_mla_decode.py tests/test_mla_shared.py > $R/pytest.txt 2>&1; echo "pytest $?"; tail -3 $R/pytest.txt
gzip -f $R/src.csv; rm -f $R/src.ncu-rep
tar -czf $OUT/r17.tgz -C $OUT r17 && rm -rf $R; ls -la $OUT
