"""Offline tools: the `vllm-gaudi-unified` command and what its subcommands run.

- `cli`: the command (one parser; each subcommand module has `register(subparsers)`);
- `demo`, `trace_stats`, `bench`, `buckets`: subcommands (`warmup` and `serve` register from
  `vllm_gaudi_unified.warmup` and `vllm_gaudi_unified.vllm_plugin.serve`);
- `shapes`: replays traces to step shapes; `strategies`: the learned `trace` plan;
  `evaluate`, `plot`: a plan against traces; `simulator`: a vLLM-like scheduler making traces.

Serving never imports this package.
"""
