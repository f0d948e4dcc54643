"""Tensor parallelism through the unified runner on Gaudi: `tensor_parallel_size=2` on the stand-in.

vLLM's multiprocessing executor starts two vllm-gaudi workers with the unified runner (forked, so that each keeps
the stand-in; `vllm_model_helpers.run_mla`); vllm-gaudi initialises torch.distributed with its 'hccl' backend,
which this torch lacks, and vLLM falls back to gloo: on the stand-in HCCL is gloo over the CPU. Each worker
plans the whole step (every rank sees the same scheduler output) and runs its half of the heads. A tiny
DeepSeek-V2 (MLA, hidden 128, blocks of 32; the one-token prompts and chunks scenario of
`test_vllm_gaudi_mla_steps.py`): the same tokens as tensor-parallel 1, unpadded and padded to a bucket plan
warmed through the model on both workers; and a tiny GQA Llama (decoder backend, one KV head per rank).
"""
from __future__ import annotations

import pytest

from test_vllm_gaudi import gaudi  # noqa: F401 (also: the module's skips)
from test_vllm_gaudi_mla import _mla_engine

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

BLOCK = 32
SHORT = ("--scenario", "short", "--block-size", str(BLOCK))
#: Tensor-parallel runs sum each layer's output over the ranks (gloo all-reduce): another order of float32 sums.
LOGPROB_ATOL = 1e-4


@pytest.fixture(scope="module")
def tp_runs(tmp_path_factory):
    from dataclasses import replace

    import vllm_helpers as H
    import vllm_model_helpers as M
    from vllm_gaudi_unified.bucket_plans.exponential import exponential_plan
    from vllm_gaudi_unified.bucket_plans.prompt_graphs import learn_prompt_graphs
    from vllm_gaudi_unified.bucket_plans.settings import ServerSettings
    from vllm_gaudi_unified.bucket_plans.trace import read_trace

    root = tmp_path_factory.mktemp("tp")
    model = M.make_tiny_deepseek(str(root / "ds"), hidden=128)
    trace = str(root / "trace.jsonl")
    llama = H.make_tiny_llama(str(root / "llama"), num_kv_heads=2)  # GQA: one KV head per rank
    plan = exponential_plan(ServerSettings(block_size=BLOCK, max_num_seqs=8, max_num_batched_tokens=64,
                                           max_model_len=H.MAX_MODEL_LEN, num_blocks=128), base=8.0)

    def tp1_then_buckets() -> dict:
        nonlocal plan
        tp1 = _mla_engine(model, str(root / "tp1.json"), gaudi=True, extra=SHORT,
                          VLLM_GAUDI_UNIFIED_RECORD_TRACE=trace)
        graphs, _ = learn_prompt_graphs(plan, read_trace(trace).steps, max_graphs=4)
        plan = replace(plan, prompt_graphs=graphs)
        plan.save(str(root / "plan.json"))
        return {"tp1": tp1, "tp2_buckets": _mla_engine(model, str(root / "tp2_buckets.json"), gaudi=True,
                                                       extra=(*SHORT, "--tp", "2"),
                                                       VLLM_GAUDI_UNIFIED_BUCKETS=str(root / "plan.json"))}

    runs, *others = H.concurrently(
        tp1_then_buckets,
        lambda: {"tp2": _mla_engine(model, str(root / "tp2.json"), gaudi=True, extra=(*SHORT, "--tp", "2"))},
        lambda: {"llama_tp2": _mla_engine(llama, str(root / "llama_tp2.json"), gaudi=True,
                                          extra=(*SHORT, "--tp", "2"))},
        lambda: {"llama_tp1": _mla_engine(llama, str(root / "llama_tp1.json"), gaudi=True, extra=SHORT)})
    for other in others:
        runs.update(other)
    return runs, len(plan.buckets) + len(plan.prompt_graphs)


@pytest.mark.parametrize("run", ["tp2", "tp2_buckets", "llama_tp2"])
def test_tensor_parallel_2_matches_tp1(tp_runs, run):
    """DeepSeek-V2 (MLA) unpadded and with a bucket plan, and a tiny GQA Llama (the decoder backend)."""
    import vllm_helpers as H

    runs, warmed = tp_runs
    ref, _ = runs["llama_tp1" if run.startswith("llama") else "tp1"]
    got, log = runs[run]
    backend = "GAUDI_UNIFIED_HPU_ATTN" if run.startswith("llama") else "GAUDI_UNIFIED_HPU_MLA"
    assert ref["tensor_parallel_size"] == 1 and got["tensor_parallel_size"] == 2
    assert "Distributed backend hccl is not available; falling back to gloo" in log
    assert log.count("vllm-gaudi's model runner plans every step as one unified batch (backend "
                     f"{backend})") == 2  # one unified runner per worker
    if run == "tp2_buckets":
        assert log.count(f"warmed {warmed} buckets through the model") == 2
    worst = H.same_tokens_worst_logprob(got, ref, cases=7)
    assert worst <= LOGPROB_ATOL, worst
    print(run, "max |dlogprob| vs tensor-parallel 1", worst)
