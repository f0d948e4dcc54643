"""What "every attention kind of a step pads to one bucket" costs (host planning only, numpy + planner).

On the Gaudi path a model's sliding-window / chunked local / full layers share one KV cache group, and
the unified runner plans each step once per kind, all padded to one bucket so that one graph per bucket
holds (`vllm_plugin/hpu_kinds.py`). A windowed or chunked layer needs less work than a full one; padded
to the full layers' bucket it computes masked pairs instead. This counts, over synthetic serving steps
of three model-shaped servers, the (query, key) pairs per step summed over the layers:

- needed: what each layer's kind needs (unpadded);
- own bucket: each kind padded to its own bucket of the same plan (one graph per bucket *and kind*);
- one bucket: every kind padded to the bucket of the step's largest kind shape (what the runner does).

Usage: `python -m benchmarks.kinds_padding [--out benchmarks/results/kinds_padding.json]`.
"""
from __future__ import annotations

import json

import numpy as np

from vllm_gaudi_unified.bucket_plans.exponential import exponential_plan
from vllm_gaudi_unified.bucket_plans.settings import BUCKET_OPTIONS, ServerSettings
from vllm_gaudi_unified.vllm_plugin.hpu_kinds import AttentionKind, _plan_kind, largest_shape, step_bucket
from vllm_gaudi_unified.files import atomic_write, output_path
from vllm_gaudi_unified.tools.cli import Parser

#: name -> (layers per kind, max_model_len): the attention layout of the model each server is shaped after.
SERVERS = {
    "gemma2_like (window 4096 / full, 21 + 21 layers)": ({AttentionKind(4096): 21, AttentionKind(): 21}, 16384),
    "gpt_oss_like (window 128 / full, 12 + 12 layers)": ({AttentionKind(128): 12, AttentionKind(): 12}, 16384),
    "llama4_like (chunks of 8192 / NoPE full, 36 + 12 layers)": ({AttentionKind(0, 8192): 36, AttentionKind(): 12},
                                                                 32768),
}
BLOCK, SEQS, TOKENS = 128, 64, 2048


def steps(rng: np.random.Generator, max_len: int, n: int = 40):
    """Serving steps: up to SEQS decodes with contexts spread over the model length, plus (one step in
    two) a prompt chunk filling the token budget at a random context."""
    for i in range(n):
        d = int(rng.integers(8, SEQS))
        ctx = rng.integers(1, max_len - TOKENS - 1, d)
        q = np.ones(d, np.int64)
        if i % 2:
            ctx = np.append(ctx, rng.integers(0, max_len - TOKENS))
            q = np.append(q, TOKENS - d)
        need = -(-(ctx + q) // BLOCK)
        table = np.zeros((len(q), need.max()), np.int64)
        perm = rng.permutation(np.arange(1, 1 + need.sum()))
        table[np.arange(table.shape[1]) < need[:, None]] = perm
        yield q, ctx, table


def measure(seed: int = 0) -> dict:
    report = {}
    for name, (layers, max_len) in SERVERS.items():
        settings = ServerSettings(block_size=BLOCK, max_num_seqs=SEQS + 1, max_num_batched_tokens=TOKENS,
                                  max_model_len=max_len, num_blocks=(SEQS + 1) * (max_len // BLOCK) + 1)
        plan = exponential_plan(settings)
        opts = BUCKET_OPTIONS
        needed = own = one = 0
        for q, ctx, table in steps(np.random.default_rng(seed), max_len):
            plans = {k: _plan_kind(k, q, ctx, table, BLOCK, opts) for k in layers}
            target = step_bucket([p.shape for p in plans.values()], plan)
            for k, p in plans.items():
                own_b = plan.find(p.shape)
                needed += p.work_needed.total * layers[k]
                own += _planned(own_b, p, opts) * layers[k]
                one += _planned(target, p, opts) * layers[k]
            assert target == plan.find(largest_shape([p.shape for p in plans.values()]))
        report[name] = {"pairs_needed": needed, "own_bucket_per_kind": own, "one_bucket_per_step": one,
                        "one_over_own": round(one / own, 3), "one_over_needed": round(one / needed, 3),
                        "own_over_needed": round(own / needed, 3)}
        print(name, json.dumps(report[name]), flush=True)
    return report


def _planned(bucket, plan, opts) -> int:
    """Pairs a plan computes once padded to `bucket` (`StepPlan.work_planned` of the padded plan)."""
    from dataclasses import replace

    return replace(plan, bucket=bucket).work_planned.total


def main(argv=None) -> int:
    parser = Parser(description=__doc__)
    parser.add_argument("--out", type=output_path, default=None, help="write the report here (JSON)")
    args = parser.parse_args(argv)
    report = measure()
    if args.out:
        with atomic_write(args.out) as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
