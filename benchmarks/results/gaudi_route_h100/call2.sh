#!/bin/bash
# gaudi23 call 2: before (main's checkout root) and after (.wt/gaudi23), both on the Gaudi route
ROOT=$PWD
export VLLM_GAUDI_TARBALL=$ROOT/.wt/peer/vllm-gaudi-091bbadd.tar.gz
export VLLM_GAUDI_UNIFIED_GAUDI_ROUTE=1
SC=chunked_2x2k_6k,parallel_sampling,decode_256x2k,decode_ragged,shared_prefix,mixed,prefill_4x2k
nvidia-smi --query-gpu=name --format=csv,noheader
cd $ROOT && git log --oneline -1 > $OUT/before_commit.txt
PYTHONPATH=$ROOT timeout 115 python -m benchmarks.speed14 --out $OUT/before --block-sizes 128,16 --scenarios $SC --methods ours > $OUT/before.log 2>&1
cd $ROOT/.wt/gaudi23
PYTHONPATH=$PWD timeout 285 python -m benchmarks.speed14 --out $OUT/after --block-sizes 128,16 --scenarios $SC --peer-variants compiled --variants "step=step_bias:1" > $OUT/after.log 2>&1
grep -h "ms  floor" $OUT/before.log $OUT/after.log
