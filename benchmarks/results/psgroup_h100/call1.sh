#!/bin/bash
# issue 23 parallel sampling, call 1 (run from .wt/psgroup, a copy of branch psgroup; ROOT: main's checkout):
# kernels of the step before (main) / after, then speed14 after / before at block 128 and 16 on the
# issue-23 decode scenarios, variants of the new rule on parallel sampling (and the Gaudi route), CUDA tests.
export PYTHONUNBUFFERED=1; L=$OUT/all.log; W=$PWD; ROOT=$(cd ../.. && pwd)
nvidia-smi --query-gpu=name,driver_version --format=csv >> $L
SC=parallel_sampling,shared_prefix,decode_256x2k,mixed,decode_64x8k,decode_ragged
echo "== kernels before $(date -u)" >> $L
(cd $ROOT && PYTHONPATH=$ROOT timeout 45 python -m benchmarks.gpu_kernels --out $OUT/kbefore --scenarios parallel_sampling --block-sizes 128,16 --top 30 >> $L 2>&1)
echo "== kernels after $(date -u)" >> $L
PYTHONPATH=$W timeout 70 python -m benchmarks.gpu_kernels --out $OUT/kafter --scenarios parallel_sampling --block-sizes 128,16 --top 30 --variants "p128=uk_progs:1;p2k=uk_progs:2048" >> $L 2>&1
echo "== after $(date -u)" >> $L
PYTHONPATH=$W timeout 110 python -m benchmarks.speed14 --out $OUT/after --block-sizes 128,16 --scenarios $SC --methods ours --time-budget 95 >> $L 2>&1
echo "== before $(date -u)" >> $L
(cd $ROOT && PYTHONPATH=$ROOT timeout 100 python -m benchmarks.speed14 --out $OUT/before --block-sizes 128,16 --scenarios $SC --methods ours --time-budget 85 >> $L 2>&1)
echo "== variants $(date -u)" >> $L
PYTHONPATH=$W timeout 90 python -m benchmarks.speed14 --out $OUT/variants --block-sizes 128,16 --scenarios parallel_sampling,shared_prefix --methods ours --time-budget 75 --variants "old=uk_shrows:0;p128=uk_progs:1;p1k=uk_progs:1024;p2k=uk_progs:2048;gaudi=gaudi:1" >> $L 2>&1
echo "== tests $(date -u)" >> $L
PYTHONPATH=$W timeout 100 python -m pytest -q tests/test_shared_kernel.py tests/test_fp8_fused.py -p no:cacheprovider > $OUT/tests.log 2>&1
echo "tests rc=$?" >> $L; tail -3 $OUT/tests.log >> $L
echo "== end $(date -u)" >> $L
grep -E "^\[|^==|passed|failed|rc=|Error" $L
