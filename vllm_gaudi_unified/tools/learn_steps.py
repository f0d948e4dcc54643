"""The steps a bucket plan learns from: recorded traces or simulated workloads (a mix by default), its
prompt graphs, and the steps left for its buckets once the prompt graphs take theirs."""
from __future__ import annotations

from dataclasses import replace

import numpy as np


def off_prompt_graphs(traces, settings, cap, args):
    """The step shapes of `traces` the plan's buckets must serve, the sources to see at lower loads
    (`robust.load_scaled_shapes`), a plan holding the prompt graphs learned from the traces, and with `--parts`
    the steps' `step_parts.grid_splits` (for `with_route_padding`; else None). The prompt graphs are learned without
    the steps those prompt graphs take, which never run in a bucket. Learned with them, the buckets spent
    graphs on shapes no step pads to. The probe has no top graphs (`prompt_graphs.top_graphs`): the bursts
    they hold, left to the buckets, give the plan `csu` buckets between the learned ones and the limits, for
    the bursts no top graph holds (8 `csu` buckets of 50 at the 8B setting, 5 with the bursts left out)."""
    from vllm_gaudi_unified.bucket_plans.bucket_plan import BucketPlan
    from vllm_gaudi_unified.bucket import bucket_from_sizes
    from vllm_gaudi_unified.bucket_plans.prompt_graphs import on_prompt_graphs
    from vllm_gaudi_unified.tools.shapes import StepShapes

    parts = [s for s, _ in traces]
    kw = {} if cap is None else {"gather_cap": cap}
    probe = with_prompt_graphs(BucketPlan([bucket_from_sizes((1, 0, 1, 1, 0))], settings, **kw), traces, args,
                               with_top=False)
    if not probe.prompt_graphs:
        return parts, [src for _, src in traces], probe, None
    out, sources, splits = [], [], []
    for shapes, src in traces:
        steps = steps_of(src)
        if getattr(args, "parts", False):  # each step whose grid a grid graph takes leaves its rest to the buckets
            from vllm_gaudi_unified.step_parts import grid_splits, rest_steps
            from vllm_gaudi_unified.tools.shapes import shapes_of_steps

            splits += grid_splits(probe, steps)
            rest = rest_steps(probe, steps, splits[len(splits) - len(steps):])
            out.append(shapes_of_steps(rest, settings, *shapes.sources[:1]))
            sources.append(rest)
            continue
        taken = on_prompt_graphs(probe, steps) if len(steps) == len(shapes) else np.zeros(len(shapes), bool)
        keep = ~taken if (~taken).any() else np.ones(len(shapes), bool)
        out.append(StepShapes(shapes.sizes[keep], shapes.needed[keep], shapes.block_size, shapes.sources))
        sources.append([s for s, k in zip(steps, keep) if k] if len(steps) == len(shapes) else src)
    return out, sources, probe, splits or None


def graphs_of(probe, plan):
    """`plan` with the prompt graphs (and their info) `_off_prompt_graphs` learned."""
    info = {k: probe.info[k] for k in ("prompt_steps", "prompt_steps_on_prompt_graphs", "prompt_graph_candidates",
                                       "parts") if k in probe.info}
    return replace(plan, prompt_graphs=probe.prompt_graphs, info={**plan.info, **info})


def with_route_padding(plan, traces, splits=None):
    """`plan` with `expected_padding_on_routes` in its info where it has prompt graphs: the padding of the steps
    of `traces` on the routes a server takes (`prompt_graphs.padding_on_routes`, or `step_parts.padding_in_parts`
    with the steps' `splits` where found; what `buckets evaluate` prints), each step with prompts in its prompt
    graph or tiled bucket, or in parts. (`expected_padding_waste` pads every step to a bucket, the measure of the
    buckets alone.)"""
    if not plan.prompt_graphs:
        return plan
    from vllm_gaudi_unified.bucket_plans.prompt_graphs import padding_on_routes
    from vllm_gaudi_unified.step_parts import in_parts, padding_in_parts

    steps = [s for _, src in traces for s in steps_of(src)]
    routes = padding_in_parts(plan, steps, splits) if in_parts(plan) else padding_on_routes(plan, steps)
    return replace(plan, info={**plan.info, "expected_padding_on_routes": round(routes["padding"], 4)})


def steps_of(src):
    """The TraceSteps of a learning source: a trace path, or simulated steps."""
    from vllm_gaudi_unified.bucket_plans.trace import read_trace

    return read_trace(src).steps if isinstance(src, str) else src


def with_prompt_graphs(plan, traces, args, with_top: bool = True):
    """`plan` with `--prompt-graphs` prompt graphs learned from the steps of `traces` (`learning_traces`); the
    top graphs with `with_top` (`learn_prompt_graphs`)."""
    if not args.prompt_graphs:
        return plan
    from vllm_gaudi_unified.bucket_plans.prompt_graphs import learn_prompt_graphs

    from vllm_gaudi_unified.step_parts import learn_grid_graphs

    runs = [steps_of(src) for _, src in traces]
    steps = [s for run in runs for s in run]
    parts = getattr(args, "parts", False)  # (a plan of grid graphs says so: `step_parts.in_parts`)
    graphs, info = (learn_grid_graphs if parts else learn_prompt_graphs)(
        plan, steps, args.prompt_graphs, sources=[i for i, run in enumerate(runs) for _ in run], with_top=with_top)
    return replace(plan, prompt_graphs=graphs, info={**plan.info, **info, **({"parts": True} if parts else {})})


def learning_traces(args, settings):
    """(shapes, source) per trace to learn from: each --trace, or simulated seeds of --workload."""
    from vllm_gaudi_unified.tools.shapes import shapes_of_steps, shapes_of_trace
    from vllm_gaudi_unified.bucket_plans.simulator import SchedulerConfig, Simulator
    from vllm_gaudi_unified.bucket_plans.workloads import workload_from, workloads_of

    if args.trace:
        return [(shapes_of_trace(t, settings, jobs=args.jobs, progress=not args.no_progress), t) for t in args.trace]
    sched = SchedulerConfig.from_settings(settings, draft_acceptance=args.draft_acceptance)
    out = []
    from tqdm import tqdm

    for name in workloads_of(args.workload):
        work = workload_from(name)
        for seed in (int(x) for x in args.seeds.split(",") if x.strip()):
            # The step count is not known ahead (requests arrive and finish): a counting bar per seed.
            with tqdm(desc=f"simulating {name} seed {seed}", unit="step", disable=args.no_progress,
                      leave=False) as bar:
                steps = []
                for step in Simulator(sched, work, seed).steps():
                    steps.append(step)
                    bar.update(1)
            out.append((shapes_of_steps(steps, settings, f"simulated:{name}:seed{seed}"), steps))
    return out
