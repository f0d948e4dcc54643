# The one device call (H100) for the split prompt form: probe, speed14 (5 rounds, ours split and single
# beside vllm-gaudi's ops compiled), kernel profiles of the chunked prefill (split, single, peer).
# Run from the tree's root with VLLM_GAUDI_TARBALL set to vllm-gaudi's archive.
cp SOURCE_COMMIT $OUT/commit.txt 2>/dev/null; nvidia-smi -L > $OUT/gpu.txt  # SOURCE_COMMIT: written by the copy step
PYTHONPATH=$PWD timeout 40 python benchmarks/results/split_ctx_h100/probe.py > $OUT/probe.log 2>&1; echo "probe rc $?"
timeout 330 python -m benchmarks.speed14 --out $OUT/s --block-sizes 128 --rounds 5 --peer-variants compiled \
    --scenarios chunked_2x2k_6k,prefill_4x2k,mixed --time-budget 300 \
    --variants "gaudi=gaudi:1;gaudi_single=gaudi:1,prompt_split:0" > $OUT/speed14.log 2>&1
echo "speed14 rc $?"
timeout 45 python -m benchmarks.kernel_profile --cases chunked_2x2k_6k:128 --variant gaudi:1 --peer \
    > $OUT/kernel_profile_split.txt 2>&1; echo "profile split rc $?"
timeout 35 python -m benchmarks.kernel_profile --cases chunked_2x2k_6k:128 --variant gaudi:1,prompt_split:0 \
    > $OUT/kernel_profile_single.txt 2>&1; echo "profile single rc $?"
