#!/bin/bash
# issue 23 decode groups, call 1 (one command line in the run tool; here as a script): CUDA tests, before
# (main's checkout, "base") / after at block 128, shared tile keys and unique-kernel split variants, kernels
# (the "after" tree of this call: tile rows per step, and per-token splits in the unique kernel as a knob,
# uk_token, dropped afterwards: slower, see call1_dec_speed14.json)
export PYTHONUNBUFFERED=1; L=$OUT/all.log; cd .wt/cudadec; W=$PWD
PYTHONPATH=$W timeout 100 python -m pytest -q -x tests/test_fused.py tests/test_fp8_fused.py -p no:cacheprovider >> $L 2>&1
(cd ../.. && PYTHONPATH=$PWD timeout 90 python -m benchmarks.speed14 --out $OUT/base --block-sizes 128 --scenarios shared_prefix,parallel_sampling,decode_ragged,decode_256x2k,decode_64x8k,mixed --methods ours --time-budget 75 >> $L 2>&1)
PYTHONPATH=$W timeout 70 python -m benchmarks.speed14 --out $OUT/shared --block-sizes 128 --scenarios shared_prefix,parallel_sampling,mixed --methods ours --time-budget 55 --variants "keys2k=shared_tile_keys:2048;keys256=shared_tile_keys:256" >> $L 2>&1
PYTHONPATH=$W timeout 80 python -m benchmarks.speed14 --out $OUT/dec --block-sizes 128 --scenarios decode_ragged,decode_256x2k,decode_64x8k --methods ours --time-budget 65 --variants "tok1k=uk_token:1024;tok2k=uk_token:2048;split2k=uk_split:2048" >> $L 2>&1
PYTHONPATH=$W timeout 70 python -m benchmarks.gpu_kernels --out $OUT/k --scenarios shared_prefix,parallel_sampling,decode_ragged,decode_256x2k --variants "fixed8=shared_rows_max:8" >> $L 2>&1
