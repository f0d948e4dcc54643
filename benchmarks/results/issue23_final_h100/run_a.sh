# Call A (H100, device tool, carry .wt/peer): issue 23's scenarios on both routes beside vllm-gaudi's ops with
# everything merged (the prompt route's split form included), then prompt shapes the goals were not tuned on,
# split against the one call, and vLLM's Triton kernel on those new shapes. Results packed in one archive.
export VLLM_GAUDI_TARBALL=$PWD/.wt/peer/vllm-gaudi-091bbadd.tar.gz
R=$OUT/r; mkdir -p $R; git log -1 --format=%H > $R/commit.txt 2>/dev/null; nvidia-smi -L > $R/gpu.txt
python -m benchmarks.speed14 --out $R/s128 --block-sizes 128 --scenarios all --peer-variants graph,compiled \
    --variants "gaudi=gaudi:1" > $R/s128.log 2>&1; echo "speed14 rc $?"
python -m benchmarks.speed14 --out $R/rounds --block-sizes 128 --rounds 3 --peer-variants compiled \
    --scenarios chunked_2x2k_6k,prefill_4x2k,parallel_sampling,chunked_1x4k_12k,chunked_8x512_2k,chunked_ragged,prefill_ragged \
    --variants "gaudi=gaudi:1;gsingle=gaudi:1,prompt_split:0" > $R/rounds.log 2>&1; echo "rounds rc $?"
python -m benchmarks.triton_peer run --archive .wt/peer/vllm-triton-0.32.0.tar.gz --out $R/triton --block-sizes 128 \
    --scenarios chunked_1x4k_12k,chunked_8x512_2k,chunked_ragged,prefill_ragged > $R/triton.log 2>&1; echo "triton rc $?"
python -m benchmarks.routes $R/s128/speed14.json $R/rounds/speed14.json | tee $R/routes.md
python -m benchmarks.triton_peer run --table $R/triton/triton_peer.json | tee $R/triton.md
tar -czf $OUT/a.tar.gz -C $OUT r
