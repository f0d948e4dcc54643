#!/bin/bash
# issue 23 parallel sampling, call 2 (run from .wt/psgroup, a copy of branch psgroup; ROOT: main's checkout):
# the kernel's token order by rank (no sort) added since call 1. Kernels after, speed14 after / before at block
# 128 and 16, the Gaudi route after / before, variants on parallel sampling, CUDA tests.
export PYTHONUNBUFFERED=1; L=$OUT/all.log; W=$PWD; ROOT=$(cd ../.. && pwd)
nvidia-smi --query-gpu=name,driver_version --format=csv >> $L
SC=parallel_sampling,shared_prefix,decode_256x2k,mixed,decode_64x8k,decode_ragged
echo "== kernels after $(date -u)" >> $L
PYTHONPATH=$W timeout 75 python -m benchmarks.gpu_kernels --out $OUT/kafter --scenarios parallel_sampling,shared_prefix --block-sizes 128,16 --top 30 >> $L 2>&1
echo "== after $(date -u)" >> $L
PYTHONPATH=$W timeout 105 python -m benchmarks.speed14 --out $OUT/after --block-sizes 128,16 --scenarios $SC --methods ours --time-budget 90 >> $L 2>&1
echo "== before $(date -u)" >> $L
(cd $ROOT && PYTHONPATH=$ROOT timeout 95 python -m benchmarks.speed14 --out $OUT/before --block-sizes 128,16 --scenarios $SC --methods ours --time-budget 80 >> $L 2>&1)
echo "== gaudi after $(date -u)" >> $L
PYTHONPATH=$W timeout 50 python -m benchmarks.speed14 --out $OUT/gaudi_after --block-sizes 128 --scenarios parallel_sampling,shared_prefix --methods ours --time-budget 40 --variants "gaudi=gaudi:1" >> $L 2>&1
echo "== gaudi before $(date -u)" >> $L
(cd $ROOT && PYTHONPATH=$ROOT timeout 50 python -m benchmarks.speed14 --out $OUT/gaudi_before --block-sizes 128 --scenarios parallel_sampling,shared_prefix --methods ours --time-budget 40 --variants "gaudi=gaudi:1" >> $L 2>&1)
echo "== variants $(date -u)" >> $L
PYTHONPATH=$W timeout 70 python -m benchmarks.speed14 --out $OUT/variants --block-sizes 128 --scenarios parallel_sampling --methods ours --time-budget 60 --variants "old=uk_shrows:0;p1k=uk_progs:1024;w8=uk_warps:8;st3=uk_stages:3;sort=uk_rank:0" >> $L 2>&1
echo "== tests $(date -u)" >> $L
PYTHONPATH=$W timeout 90 python -m pytest -q tests/test_shared_kernel.py tests/test_fp8_fused.py -p no:cacheprovider > $OUT/tests.log 2>&1
echo "tests rc=$?" >> $L; tail -3 $OUT/tests.log >> $L
echo "== end $(date -u)" >> $L
grep -E "^\[|^==|passed|failed|rc=|Error" $L
