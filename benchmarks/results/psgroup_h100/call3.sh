#!/bin/bash
# issue 23 parallel sampling, call 3 (run from .wt/psgroup; ROOT: main's checkout): the final code (call 2's,
# the rank's arange moved into its branch) after / before / after on the block-128 scenarios the change
# could touch (the repeat shows the run-to-run spread), a rank-bound variant at block 16, CUDA tests.
export PYTHONUNBUFFERED=1; L=$OUT/all.log; W=$PWD; ROOT=$(cd ../.. && pwd)
SC=parallel_sampling,shared_prefix,decode_256x2k,mixed
echo "== after $(date -u)" >> $L
PYTHONPATH=$W timeout 70 python -m benchmarks.speed14 --out $OUT/after --block-sizes 128 --scenarios $SC --methods ours --time-budget 60 >> $L 2>&1
echo "== before $(date -u)" >> $L
(cd $ROOT && PYTHONPATH=$ROOT timeout 70 python -m benchmarks.speed14 --out $OUT/before --block-sizes 128 --scenarios $SC --methods ours --time-budget 60 >> $L 2>&1)
echo "== after2 $(date -u)" >> $L
PYTHONPATH=$W timeout 70 python -m benchmarks.speed14 --out $OUT/after2 --block-sizes 128 --scenarios $SC --methods ours --time-budget 60 >> $L 2>&1
echo "== rank bound at block 16 $(date -u)" >> $L
PYTHONPATH=$W timeout 60 python -m benchmarks.speed14 --out $OUT/rank16 --block-sizes 16 --scenarios parallel_sampling,shared_prefix --methods ours --time-budget 50 --variants "rank4k=uk_rank:4096" >> $L 2>&1
echo "== tests $(date -u)" >> $L
PYTHONPATH=$W timeout 130 python -m pytest -q tests/test_shared_kernel.py tests/test_fused.py -p no:cacheprovider > $OUT/tests.log 2>&1
echo "tests rc=$?" >> $L; tail -3 $OUT/tests.log >> $L
echo "== end $(date -u)" >> $L
grep -E "^\[|^==|passed|failed|rc=|Error" $L
