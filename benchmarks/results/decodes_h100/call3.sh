#!/bin/bash
# issue 23 decode groups, call 3: CUDA tests in full, then before (main) / after (this branch) on the shared-prefix steps
export PYTHONUNBUFFERED=1
L=$OUT/all.log
W=$PWD
ROOT=$(cd ../.. && pwd)
SC=shared_prefix,parallel_sampling,decode_256x2k
echo "== after $(date -u)" >> $L
PYTHONPATH=$W timeout 70 python -m benchmarks.speed14 --out $OUT/after --block-sizes 128,16 --scenarios $SC --methods ours --time-budget 60 >> $L 2>&1
echo "== before $(date -u)" >> $L
(cd $ROOT && PYTHONPATH=$ROOT timeout 70 python -m benchmarks.speed14 --out $OUT/before --block-sizes 128,16 --scenarios $SC --methods ours --time-budget 60 >> $L 2>&1)
echo "== kernels $(date -u)" >> $L
PYTHONPATH=$W timeout 35 python -m benchmarks.gpu_kernels --out $OUT/k --scenarios shared_prefix,parallel_sampling --block-sizes 128 >> $L 2>&1
echo "== tests $(date -u)" >> $L
PYTHONPATH=$W timeout 220 python -m pytest -q tests/test_fused.py tests/test_fp8_fused.py tests/test_merge.py -p no:cacheprovider > $OUT/tests.log 2>&1
echo "tests rc=$?" >> $L
tail -5 $OUT/tests.log >> $L
echo "== end $(date -u)" >> $L
grep -E "^\[|^==|passed|failed|rc=|Error" $L
