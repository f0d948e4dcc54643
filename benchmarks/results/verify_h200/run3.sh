#!/bin/bash
# Issue 36, third device call: benchmarks.verify after the causal flash call's grid was bounded by a unit's
# tokens and its running max made one kernel; the Gaudi route compiled for the larger verify steps too.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD VLLM_GAUDI_TARBALL=$PWD/_shared/third_party/vllm-gaudi-091bbadd.tar.gz
L=$OUT/all.log
echo "== verify $(date -u)" >> $L
timeout 140 python3 -m benchmarks.verify --out $OUT --no-peers --time-budget 100 \
  --compile verify_64x4_3k,verify_64x8_3k,verify_ragged_96 >> $L 2>&1
echo "verify rc=$? $(date -u)" >> $L
grep -E "^\[|^==|rc=|Error|^\|" $L
