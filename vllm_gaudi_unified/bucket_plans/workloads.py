"""Simulated workloads: who sends what and when (`WorkloadConfig`), and the named ones."""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields


@dataclass(frozen=True)
class WorkloadConfig:
    """Who sends what, and when. Lengths are in tokens; log-normal by median and sigma."""

    num_requests: int = 1000
    arrival_rate: float = 2.5  #: mean new requests per step (Poisson); 0 = all arrive at step 0
    prompt_median: float = 200.0
    prompt_sigma: float = 1.0
    prompt_max: int = 4096
    output_median: float = 250.0
    output_sigma: float = 0.8
    output_max: int = 1500
    prefix_share: float = 1.0  #: share of conversations starting with a common prefix
    prefix_lens: tuple = (512,)  #: one entry per common prefix (system prompt)
    followup_share: float = 0.35  #: share of requests resending an earlier conversation + a new message
    parallel_share: float = 0.0  #: share of requests sampled with n > 1
    parallel_n: int = 4

    def __post_init__(self):
        if self.num_requests <= 0:
            raise ValueError(f"num_requests must be positive, got {self.num_requests}")
        for name in ("prefix_share", "followup_share", "parallel_share"):
            v = getattr(self, name)
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {v}")
        if self.arrival_rate < 0:
            raise ValueError(f"arrival_rate must be >= 0, got {self.arrival_rate}")
        for name in ("prompt_median", "output_median", "prompt_max", "output_max"):
            v = getattr(self, name)
            if v <= 0:
                raise ValueError(f"{name} must be positive, got {v}")
        if self.parallel_n < 1:
            raise ValueError(f"parallel_n must be >= 1, got {self.parallel_n}")


#: Named workloads. `chat` and `mixed` follow the workloads of the recorded traces
#: in bucketing/traces/ (see their README), with their own seeds.
WORKLOADS: dict[str, WorkloadConfig] = {
    "chat": WorkloadConfig(num_requests=1200, arrival_rate=2.5, prompt_median=200, prompt_sigma=1.0,
                           prompt_max=4096, output_median=250, output_sigma=0.8, output_max=1500,
                           prefix_share=1.0, prefix_lens=(512,), followup_share=0.35),
    "mixed": WorkloadConfig(num_requests=300, arrival_rate=0.0, prompt_median=400, prompt_sigma=1.0,
                            prompt_max=6000, output_median=120, output_sigma=0.8, output_max=1000,
                            prefix_share=0.4, prefix_lens=(256, 384, 512, 1024, 1536, 2048),
                            followup_share=0.0, parallel_share=0.1, parallel_n=4),
    # Documents (RAG, long system prompts, agents' tool outputs): most requests over one of a few long
    # shared prefixes, some sampled n > 1; decode groups of very different sizes read them, prompts sit
    # over long cached context.
    "rag": WorkloadConfig(num_requests=400, arrival_rate=1.5, prompt_median=250, prompt_sigma=1.0,
                          prompt_max=3000, output_median=150, output_sigma=0.8, output_max=1200,
                          prefix_share=0.6, prefix_lens=(1024, 1536, 2560, 4096), followup_share=0.1,
                          parallel_share=0.15, parallel_n=6),
    # Long prompts (documents pasted whole, long conversations): chunked prefill over long context.
    "long": WorkloadConfig(num_requests=150, arrival_rate=0.4, prompt_median=2500, prompt_sigma=0.6,
                           prompt_max=7000, output_median=200, output_sigma=0.8, output_max=1000,
                           prefix_share=0.2, prefix_lens=(512,), followup_share=0.2),
}

#: Mixes of named workloads, each simulated on its own and counted equally: what a default plan learns from,
#: since a server gets whatever traffic comes (a plan learned from chat alone padded RAG traffic 2.4x).
MIXES: dict[str, tuple[str, ...]] = {"mix": ("chat", "rag", "long")}


def workloads_of(name: str) -> tuple[str, ...]:
    """The named workloads `name` stands for: a mix's, or itself."""
    if name not in WORKLOADS and name not in MIXES:
        raise ValueError(f"unknown workload {name!r}; known: {', '.join([*WORKLOADS, *MIXES])}")
    return MIXES.get(name, (name,))


def workload_from(name: str, **overrides) -> WorkloadConfig:
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}")
    base = asdict(WORKLOADS[name])
    known = {f.name for f in fields(WorkloadConfig)}
    base.update({k: v for k, v in overrides.items() if k in known and v is not None})
    base["prefix_lens"] = tuple(base["prefix_lens"])
    return WorkloadConfig(**base)
