# Call A (H100, device tool): issue 23's scenarios on both routes beside vllm-gaudi's ops, then vLLM's
# Triton kernel beside our CUDA default. Carry .wt/peer (the two peers' archives).
export VLLM_GAUDI_TARBALL=$PWD/.wt/peer/vllm-gaudi-091bbadd.tar.gz
git log -1 --format=%H > $OUT/commit.txt 2>/dev/null; nvidia-smi -L > $OUT/gpu.txt
python -m benchmarks.speed14 --out $OUT/s128 --block-sizes 128 --scenarios all --peer-variants graph,compiled \
    --variants "gaudi=gaudi:1" > $OUT/s128.log 2>&1
echo "speed14 rc $?"
# The goals within run-to-run spread of their limits (chunked and prefill on the Gaudi route, parallel sampling
# on both routes), five rounds each, ours and the peer in turn: the tables take the median round.
python -m benchmarks.speed14 --out $OUT/rounds --block-sizes 128 --rounds 5 --peer-variants compiled \
    --scenarios chunked_2x2k_6k,prefill_4x2k,parallel_sampling --variants "gaudi=gaudi:1" > $OUT/rounds.log 2>&1
echo "rounds rc $?"
python -m benchmarks.triton_peer run --archive .wt/peer/vllm-triton-0.32.0.tar.gz --out $OUT/triton \
    --block-sizes 128 > $OUT/triton.log 2>&1
echo "triton_peer rc $?"
python -m benchmarks.routes $OUT/s128/speed14.json $OUT/rounds/speed14.json
python -m benchmarks.triton_peer run --table $OUT/triton/triton_peer.json
