#!/bin/bash
# issue 23 decode groups, call 2: CUDA tests, then before (main's checkout) / after (this branch), then kernels
# (the "after" tree of this call still had an int32-key merge in the fused shared path, dropped afterwards:
# no gain, see call2_variants_speed14.json 'floatmax'; call 3 re-measured the shared steps without it)
export PYTHONUNBUFFERED=1
L=$OUT/all.log
W=$PWD
ROOT=$(cd ../.. && pwd)
SC=shared_prefix,parallel_sampling,decode_ragged,decode_256x2k,decode_64x8k,mixed
nvidia-smi --query-gpu=name,driver_version --format=csv >> $L
echo "== tests $(date -u)" >> $L
PYTHONPATH=$W timeout 90 python -m pytest -q -x tests/test_fused.py tests/test_fp8_fused.py tests/test_merge.py -p no:cacheprovider >> $L 2>&1
echo "tests rc=$?" >> $L
echo "== after $(date -u)" >> $L
PYTHONPATH=$W timeout 100 python -m benchmarks.speed14 --out $OUT/after --block-sizes 128,16 --scenarios $SC,chunked_2x2k_6k,prefill_4x2k --methods ours --time-budget 90 >> $L 2>&1
echo "== before $(date -u)" >> $L
(cd $ROOT && PYTHONPATH=$ROOT timeout 100 python -m benchmarks.speed14 --out $OUT/before --block-sizes 128,16 --scenarios $SC,chunked_2x2k_6k,prefill_4x2k --methods ours --time-budget 90 >> $L 2>&1)
echo "== variants $(date -u)" >> $L
PYTHONPATH=$W timeout 50 python -m benchmarks.speed14 --out $OUT/variants --block-sizes 128 --scenarios shared_prefix,parallel_sampling --methods ours --time-budget 40 --variants "floatmax=sh_intmax:0;rows8=shared_rows_max:8" >> $L 2>&1
echo "== kernels $(date -u)" >> $L
PYTHONPATH=$W timeout 40 python -m benchmarks.gpu_kernels --out $OUT/k --scenarios shared_prefix,parallel_sampling,decode_256x2k --block-sizes 128 >> $L 2>&1
echo "== end $(date -u)" >> $L
grep -E "^\[|^==|passed|failed|rc=|Error" $L
