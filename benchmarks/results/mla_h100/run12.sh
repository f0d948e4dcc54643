#!/bin/bash
# Call 12 (device, carry .wt/peer and .wt/before): MLA at a tensor-parallel shard's 16 heads (every route,
# vllm-gaudi's flat_pa_mla beside), and the prompt route's split form with its keys gathered as two tensors
# against the tree before that change (.wt/before), both on the Gaudi route, in alternating rounds.
export VLLM_GAUDI_TARBALL=$PWD/.wt/peer/vllm-gaudi-091bbadd.tar.gz
R=$OUT/r; mkdir -p $R; T=$PWD
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > $R/gpu.txt
timeout 200 python3 -m benchmarks.mla_decode --heads 16 --skip-prompt --profile \
  --cases decode_128x4k,shared_64x4k+256,unshared_64x4352 --out $R/mla16.json > $R/mla16.log 2>&1; echo "mla16 rc $?"
grep -E '^(shared|unshared|decode)[^ ]* \{' $R/mla16.log | python3 -c "
import sys, json
for line in sys.stdin:
    name, js = line.split(' ', 1); e = json.loads(js)
    print(name, {k: round(v, 3) for k, v in e.items() if isinstance(v, float) and (k.endswith('_ms') or k.endswith('err'))})"
for round in 1 2; do
  for t in after before; do
    D=$T; [ $t = before ] && D=$T/.wt/before
    (cd $D && timeout 150 python3 -m benchmarks.speed14 --out $R/split_${t}_$round --block-sizes 128 --methods ours \
      --scenarios chunked_2x2k_6k,chunked_1x4k_12k,chunked_8x512_2k --variants "gaudi=gaudi:1" > $R/split_${t}_$round.log 2>&1; echo "$t $round rc $?")
    grep -E "^\[chunked" $R/split_${t}_$round.log | grep -v "nan" | sed "s/^/$t $round /"
  done
done
tar -czf $OUT/r12.tar.gz -C $OUT r
