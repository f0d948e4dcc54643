"""Warmup's peak device memory from the plan's model: the largest graph's working set, what warmup keeps
across graphs and one layer's KV cache, counted by hand here for a two-graph plan."""
from __future__ import annotations

from dataclasses import replace

from vllm_gaudi_unified import Bucket
from vllm_gaudi_unified.bucket_plans import BucketPlan, ModelSpec, ServerSettings
from vllm_gaudi_unified.bucket_plans.memory import graph_bytes, warmup_memory
from vllm_gaudi_unified.tools.cli import main

SETTINGS = ServerSettings(block_size=4, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, num_blocks=64)
MODEL = ModelSpec(num_layers=1, num_qo_heads=4, num_kv_heads=2, head_dim=8, hidden_size=32, vocab_size=64)


def test_two_graphs_counted_by_hand(tmp_path, capsys):
    o = SETTINGS.options  # 128 slots a shared tile at block size 4 (512 keys), 16 rows; causal tiles of 64
    assert (SETTINGS.blocks_per_tile, o.shared_rows, o.causal_tile) == (128, 16, 64)
    tiled = Bucket("csu", 16, 128, 8, 4, 2)
    graph = Bucket("--u", 16, 0, 4, 2, 0, 1, 16, 8)  # one prompt of 16 rows over 8 context blocks (32 keys)
    plan = BucketPlan([tiled], SETTINGS, MODEL, prompt_graphs=[graph])
    kv_slot = 2 * 4 * 2 * 8 * 2  # K and V of one block: 2 x bs x Hkv x D x B
    io = 16 * (2 * 4 + 2 * 2) * 8 * 2
    assert graph_bytes(tiled, SETTINGS, MODEL) == {
        "gathered_kv": (128 + 8) * kv_slot, "scores": 4 * 4 * (128 * 16 * 4 + 8 * 4 + 2 * 64 * 64),
        "inputs_outputs": io, "indices": 8 * (16 + 136 + 4 + 2),
        # rows the one merge holds: a shared tile's 16, 8 unique slots, 2 causal tiles of 64, the 16-row accumulator
        "partials": (16 + 8 + 2 * 64 + 16) * 4 * (8 + 2) * 4}
    # the prompt call: 16 rows x 32 context keys, and its new keys causal (no split below SPLIT_MIN_PAIRS: a square)
    assert graph_bytes(graph, SETTINGS, MODEL)["scores"] == 4 * 4 * (4 * 4 + 16 * 32 + 16 * 16)
    mem = warmup_memory(plan)
    assert mem.largest == tiled and mem.working_set == sum(graph_bytes(tiled, SETTINGS, MODEL).values())
    assert mem.kept == io + 8 * (16 + 4 + 8 + 2 + 16)  # the prompt graph's inputs, outputs and indices
    assert mem.kv_cache == 64 * kv_slot and mem.peak == mem.working_set + mem.kept + mem.kv_cache
    path = str(tmp_path / "plan.json")
    plan.save(path)
    assert main(["buckets", "show", path]) == 0
    assert f"2 graphs; warmup peak device memory (the plan's model, bucket_plans/memory.py): {mem.peak / 2**30:.2f} GiB" \
        in capsys.readouterr().out
    bigger = warmup_memory(replace(plan, settings=replace(SETTINGS, num_blocks=128)))
    assert bigger.kv_cache == 2 * mem.kv_cache
