#!/bin/bash
# Run 11 (issue 26): the CUDA route's shared tiles in the MLA kernel, against the shared route in the same call;
# DRAM bytes of the kernel (Nsight Compute) for the shared step and its unshared twin; the MLA CUDA tests.
set -x
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv
python3 -m benchmarks.mla_decode --skip-prompt --skip-vllm-gaudi --profile \
  --cases shared_64x4k+256,shared_64x4k+256_tiles64,unshared_64x4352 --out $OUT/run11_routes.json > $OUT/run11_log.txt 2>&1
grep -E '^(shared|unshared)[^ ]* \{' $OUT/run11_log.txt | python3 -c "
import sys, json
for line in sys.stdin:
    name, js = line.split(' ', 1); e = json.loads(js)
    print(name, {k: round(v, 4) for k, v in e.items() if isinstance(v, float) and (k.endswith('_ms') or k.endswith('err'))})"
cat > /tmp/dram.py <<'PY'
import sys, torch
from benchmarks.mla_decode import setup, BS
shared = sys.argv[1] == "shared"
case = setup("x", [4096 + 256] * 64, 4096 // BS if shared else 0)
for _ in range(3):
    case["step"]()
torch.cuda.synchronize()
PY
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
for which in shared unshared; do
  PYTHONPATH=$PWD timeout 200 $NCU --clock-control none --metrics dram__bytes_read.sum,gpu__time_duration.sum -k regex:mla_body -s 2 -c 1 \
    python3 /tmp/dram.py $which > $OUT/run11_ncu_$which.txt 2>&1; tail -6 $OUT/run11_ncu_$which.txt
done
timeout 240 python3 -m pytest -q -x tests/test_mla_decode.py tests/test_mla_shared.py -p no:cacheprovider > $OUT/run11_pytest.txt 2>&1; tail -3 $OUT/run11_pytest.txt
