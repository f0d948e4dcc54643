#!/bin/bash
# At 0469fab: the kernel's CUDA tests (one slot per loop step at block sizes >= its keys;
# the shared-cells and batch-invariant routes that launch it too), then benchmarks.verify again (the Gaudi
# route's units as per-KV-head products, the kernel's scalar slot loads), profiles of the 64 x 4 step, and
# the CUDA route under more splits.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD VLLM_GAUDI_TARBALL=$PWD/_shared/third_party/vllm-gaudi-091bbadd.tar.gz
L=$OUT/all.log
echo "== tests $(date -u)" >> $L
timeout 170 python3 -m pytest -q -p no:cacheprovider tests/test_fp8_fused.py tests/test_shared_kernel.py -k "cuda" tests/test_verify.py > $OUT/tests.log 2>&1
echo "tests rc=$?" >> $L; tail -5 $OUT/tests.log >> $L
echo "== verify $(date -u)" >> $L
timeout 330 python3 -m benchmarks.verify --out $OUT --mla --no-peers --time-budget 260 --compile verify_64x4_3k \
  --profile verify_64x4_3k --kernel-variants "uk_progs:1024;uk_progs:2048" >> $L 2>&1
echo "verify rc=$? $(date -u)" >> $L
grep -E "^\[|^==|passed|failed|rc=|Error|^\|" $L | grep -v profile
grep -A18 "profile\]" $L | cut -c1-150 | head -80
