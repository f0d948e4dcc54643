#!/bin/bash
# At 7dd71cf (benchmarks/verify.py of 0469fab): the unique kernel's CUDA tests (verify units included), then benchmarks.verify
# (every verify scenario, both routes, their decode twins, vLLM Triton, vllm-gaudi's two forms; MLA).
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD VLLM_GAUDI_TARBALL=$PWD/_shared/third_party/vllm-gaudi-091bbadd.tar.gz
L=$OUT/all.log
nvidia-smi --query-gpu=name,driver_version --format=csv >> $L
echo "== tests $(date -u)" >> $L
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_fp8_fused.py -k "cuda or compiles" tests/test_verify.py > $OUT/tests.log 2>&1
echo "tests rc=$?" >> $L; tail -5 $OUT/tests.log >> $L
echo "== verify $(date -u)" >> $L
timeout 380 python3 -m benchmarks.verify --out $OUT --mla --time-budget 300 --compile verify_64x4_3k >> $L 2>&1
echo "verify rc=$? $(date -u)" >> $L
grep -E "^\[|^==|passed|failed|rc=|Error|^\|" $L
