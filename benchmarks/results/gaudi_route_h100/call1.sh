#!/bin/bash
# gaudi23 call 1: profiles + first measurements (run from the repo root on the device)
ROOT=$PWD
export VLLM_GAUDI_TARBALL=$ROOT/.wt/peer/vllm-gaudi-091bbadd.tar.gz
PY=python
nvidia-smi --query-gpu=name --format=csv,noheader
cd $ROOT/.wt/gaudi23
export PYTHONPATH=$PWD
timeout 60 $PY -m benchmarks.kernel_profile --cases chunked_2x2k_6k:128 --peer --variant gaudi:1 --top 16 > $OUT/prof.log 2>&1
timeout 70 $PY -m benchmarks.kernel_profile --cases parallel_sampling:128,parallel_sampling:16,decode_256x2k:16 --variant gaudi:1 --top 14 >> $OUT/prof.log 2>&1
timeout 40 $PY -m benchmarks.kernel_profile --cases parallel_sampling:128,parallel_sampling:16 --variant gaudi:1,shared_rows:16 --top 14 >> $OUT/prof.log 2>&1
timeout 140 $PY -m benchmarks.speed14 --out $OUT/d --block-sizes 128,16 --scenarios chunked_2x2k_6k,parallel_sampling --peer-variants compiled --variants "gaudi=gaudi:1;g16=gaudi:1,shared_rows:16;g16k=gaudi:1,shared_rows:16,shared_tile_keys:2048" --time-budget 120 > $OUT/all.log 2>&1
cd $ROOT
export PYTHONPATH=$ROOT
timeout 50 $PY -m benchmarks.speed14 --out $OUT/e --block-sizes 128,16 --scenarios chunked_2x2k_6k --methods ours --variants "gaudi=gaudi:1" >> $OUT/all.log 2>&1
cd $ROOT/.wt/gaudi23
export PYTHONPATH=$PWD
timeout 60 $PY -m benchmarks.speed14 --out $OUT/f --block-sizes 16 --scenarios decode_256x2k,decode_ragged --peer-variants compiled --variants "gaudi=gaudi:1" --time-budget 45 >> $OUT/all.log 2>&1
grep -h "ms  floor" $OUT/all.log
