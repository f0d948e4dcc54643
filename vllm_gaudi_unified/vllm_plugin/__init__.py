"""vLLM glue: the only part of the package that imports vLLM.

- `entry`: the two entry points vLLM calls (platform plugin, general plugin);
- `config`: the plugin's options (environment variables);
- `platform`: the CPU platform that selects the unified backend when asked;
- `backend`: the v1 attention backend (backend class, metadata, builder, impl);
- on Gaudi, subclasses of vllm-gaudi's classes (they import vllm_gaudi):
  `hpu_platform` (platform: worker class, hook check, refusals), `hpu_worker`
  (builds the runner), `hpu_runner` (one unified batch per step from its input
  batch, warmup of the bucket plan through the model), `hpu_backend` (backend,
  per-step metadata, impl in vllm-gaudi's calling convention, metadata pass-through),
  `hpu_kinds` (a KV cache group's layers by attention kind, one plan per kind per step);
- `steps`: what happens around each planned step (bucket plan, warmup, debug
  log, trace recording);
- `worker`: vLLM's CPU worker plus the bucket warmup at start-up.
- `serve`: the `vllm-gaudi-unified serve` command (`vllm serve` with the plugin on).

Importing this package imports nothing from vLLM; the modules above that need
vLLM import it themselves.
"""
