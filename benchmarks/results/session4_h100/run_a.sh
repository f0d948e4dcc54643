# Call A (H100, device tool): issue 23's scenarios on both routes beside vllm-gaudi's ops, then vLLM's
# Triton kernel beside our CUDA default. Carry .wt/peer (the two peers' archives).
export VLLM_GAUDI_TARBALL=$PWD/.wt/peer/vllm-gaudi-091bbadd.tar.gz
git log -1 --format=%H > $OUT/commit.txt 2>/dev/null; nvidia-smi -L > $OUT/gpu.txt
python -m benchmarks.speed14 --out $OUT/s128 --block-sizes 128 --scenarios all --peer-variants graph,compiled \
    --variants "gaudi=gaudi:1" > $OUT/s128.log 2>&1
echo "speed14 rc $?"
python -m benchmarks.triton_peer run --archive .wt/peer/vllm-triton-0.32.0.tar.gz --out $OUT/triton \
    --block-sizes 128 > $OUT/triton.log 2>&1
echo "triton_peer rc $?"
grep -E "floor" $OUT/s128.log | tail -40
python -m benchmarks.triton_peer run --table $OUT/triton/triton_peer.json
