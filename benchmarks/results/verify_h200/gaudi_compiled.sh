#!/bin/bash
# benchmarks.verify at 3756463 (the causal flash call's grid bounded by a unit's tokens, its running max one
# kernel: no change end to end, 0.461 -> 0.465 ms at 64 x 4, so not kept; and 0469fab's scalar slot loads in
# the unique kernel, not kept either: decode 32/8/128 -7 %, but 64/8/64 +9 % and ragged +7 %); the Gaudi route compiled for the
# larger verify steps too.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD VLLM_GAUDI_TARBALL=$PWD/_shared/third_party/vllm-gaudi-091bbadd.tar.gz
L=$OUT/all.log
echo "== verify $(date -u)" >> $L
timeout 120 python3 -m benchmarks.verify --out $OUT --no-peers --time-budget 75 \
  --compile verify_64x8_3k,verify_ragged_96 >> $L 2>&1
echo "verify rc=$? $(date -u)" >> $L
grep -E "^\[|^==|rc=|Error|^\|" $L
