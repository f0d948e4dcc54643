"""`vllm-gaudi-unified buckets ...`: generate, show, evaluate and plot bucket plans; simulate traces."""
from __future__ import annotations

import argparse
import json

import os
import time

from vllm_gaudi_unified.bucket_plans.bucket_plan import DEFAULT_MEMORY_SHARE
from vllm_gaudi_unified.bucket_plans.prompt_graphs import DEFAULT_PROMPT_GRAPHS
from vllm_gaudi_unified.tools.learn_steps import graphs_of, learning_traces, off_prompt_graphs, with_prompt_graphs, \
    with_route_padding
from vllm_gaudi_unified.tools.robust import DEFAULT_ROBUST_GRAPHS
from vllm_gaudi_unified.files import atomic_write, output_path
from vllm_gaudi_unified.flags import JOBS, POSITIVE, SEED, comma_ints, float_in, int_in, step_window
from vllm_gaudi_unified.tools.settings_flags import LEARN_NAMES, WORKLOAD_NAMES, add_model, add_settings, model_from_args, \
    settings_from_args


def register(subparsers) -> None:
    p = subparsers.add_parser("buckets", help="bucket plans: generate, show, evaluate, plot; simulate traces",
                              description="Bucket plans: which step shapes get a compiled graph.")
    sub = p.add_subparsers(dest="buckets_command", metavar="SUBCOMMAND")
    p.set_defaults(func=lambda a: (p.print_help(), 2)[1])

    g = sub.add_parser("generate", help="make a bucket plan (learned from traces, or exponential)",
                       description="Make a bucket plan for a server setting. `robust` (default) and `trace` learn "
                                   "from --trace files (several at once: each counts equally), or, without any, "
                                   "from simulated traces of --workload and --seeds.")
    g.add_argument("--strategy", choices=("robust", "trace", "exponential"), default="robust",
                   help="how buckets are chosen: robust (skeleton over the whole range + buckets learned at "
                        "several loads), trace (learned by total padded work), exponential (settings only)")
    add_settings(g)
    add_model(g)
    g.add_argument("--trace", action="append", default=[], metavar="T",
                   help="scheduler trace (.jsonl or .jsonl.gz) to learn from; repeatable")
    g.add_argument("--workload", choices=LEARN_NAMES, default="mix",
                   help="simulated workload when no --trace is given (default mix: chat, rag and long, each "
                        "simulated with every seed and counted equally)")
    g.add_argument("--seeds", type=comma_ints, default="1,2,3",
                   help="simulator seeds when no --trace is given (comma separated)")
    g.add_argument("--max-graphs", type=int_in(1, 4096), default=None,
                   help=f"most buckets in the plan, prompt graphs apart (default: robust {DEFAULT_ROBUST_GRAPHS}, trace 32)")
    g.add_argument("--target-waste", type=float_in(1.0, 1e6), default=None,
                   help="stop at the fewest buckets whose padding waste on the traces is at most this (trace)")
    g.add_argument("--resolution", type=float_in(0.5, 8.0), default=3.0,
                   help="grid points per doubling for bucket boundaries (robust, trace; default 3)")
    g.add_argument("--margin", type=float_in(0.0, 4.0), default=None,
                   help="grow learned shapes by this share before choosing, for unseen steps "
                        "(default: robust 0.1, trace 0.2)")
    g.add_argument("--margin-sizes", type=size_names, default=None, metavar="NAMES",
                   help="robust: the sizes --margin grows, comma separated, of query, shared, unique, logits, causal "
                        "(default: all)")
    g.add_argument("--skeleton-ratio", type=float_in(0.0, 1e6), default=32.0,
                   help="robust: cost ratio between neighbouring skeleton buckets (0: no skeleton; default 32)")
    g.add_argument("--load-fractions", default="0.5,0.25,0.0625",
                   help="robust: also learn from each trace with only this share of each step's requests, "
                        "for lower loads, at random and as a burst draining (comma separated; empty for none)")
    g.add_argument("--load-weight", type=float_in(0.0, 1e6), default=0.3,
                   help="robust: weight of all load-scaled steps together, against 1 for the traces (default 0.3)")
    g.add_argument("--worst", type=float_in(1.0, 1e9), default=None,
                   help="robust: steps padded beyond this ratio (time or score pairs) cost more than any "
                        "other padding (default: off)")
    g.add_argument("--memory-share", type=float_in(1e-6, 1.0), default=None,
                   help="no bucket gathers more K/V (one layer) than this share of device memory; steps "
                        f"beyond are split by the planner (robust default {DEFAULT_MEMORY_SHARE}; "
                        "exponential and trace: no cap unless given)")
    g.add_argument("--device-memory-gb", type=float_in(1e-3, 1e6), default=None,
                   help="device memory for --memory-share (default 128, Gaudi 3)")
    g.add_argument("--batch-invariant", action="store_true",
                   help="plan for batch-invariant mode (PlanOptions.batch_invariant; steps replayed through "
                        "plan_step, slower)")
    g.add_argument("--exp-base", type=float_in(1.4, 16.0), default=2.0,
                   help="growth factor of exponential ranges, 1.4 to 16 (default 2; 1.4 already makes ~25000 buckets)")
    g.add_argument("--prompt-graphs", type=int_in(0, 4096), default=DEFAULT_PROMPT_GRAPHS,
                   help="buckets with a prompt shape, learned from the traces (or simulated ones), in which "
                        "prompts and chunks run on the prompt route, one fused call each; other steps with "
                        f"prompts run on the tiled route (0: none; default {DEFAULT_PROMPT_GRAPHS})")
    g.add_argument("--parts", action="store_true",
                   help="grid graphs, a step's prompt grid apart from its other requests (`step_parts.py`): the "
                        "graphs are the buckets plus the grids, a sum; the buckets also learn each step's rest")
    g.add_argument("--miss-policy", choices=("error", "largest", "unbucketed"), default="error",
                   help="what a step no bucket covers does at serve time (default: error)")
    g.add_argument("--jobs", type=JOBS, default=None, help="processes for replaying traces (default: all cores)")
    g.add_argument("-o", "--output", type=output_path, required=True, help="plan file to write (JSON)")
    g.add_argument("--no-progress", action="store_true", help="no progress bars")
    g.set_defaults(func=cmd_generate, _parser=g)

    s = sub.add_parser("show", help="print a plan as a table", description="Print a bucket plan as a table.")
    s.add_argument("plan", metavar="PLAN", help="bucket plan JSON")
    s.add_argument("--json", action="store_true", help="print the plan file's JSON instead")
    s.set_defaults(func=cmd_show)

    e = sub.add_parser("evaluate", help="graphs, coverage and padding waste of a plan on traces",
                       description="Replay traces through the planner, pad each step to the bucket `find` "
                                   "returns, and report graphs, share of steps covered, padding waste (padded "
                                   "work / real work, work from the plan's FLOPs-and-bytes model) and the waste "
                                   "per dimension.")
    e.add_argument("plan", metavar="PLAN", help="bucket plan JSON")
    e.add_argument("--trace", action="append", required=True, metavar="T", help="scheduler trace; repeatable")
    e.add_argument("--json", type=output_path, default=None, help="also write the results to this JSON file")
    e.add_argument("--upstream", action="store_true",
                   help="also score the earlier Gaudi implementation's plan for the plan's settings (rebuilt "
                        "from its rules: 107 graphs at the 8B setting) on the same traces")
    e.add_argument("--steps", type=step_window, default=None, metavar="START:STOP",
                   help="only these steps of each trace (Python slice bounds, 0-based: 300:500 is steps "
                        "300-499); not with --upstream")
    e.add_argument("--jobs", type=JOBS, default=None, help="processes for replaying traces")
    e.add_argument("--no-progress", action="store_true", help="no progress bars")
    e.set_defaults(func=cmd_evaluate)

    pl = sub.add_parser("plot", help="PNG of a plan's buckets over a trace's steps",
                        description="Draw every step of the trace (query tokens against unique blocks, shared "
                                    "slots and causal tiles) and the plan's buckets as boxes.")
    pl.add_argument("plan", metavar="PLAN", help="bucket plan JSON")
    pl.add_argument("--trace", required=True, metavar="T", help="scheduler trace")
    pl.add_argument("-o", "--output", type=output_path, required=True, help="PNG file to write")
    pl.add_argument("--jobs", type=JOBS, default=None, help="processes for replaying the trace")
    pl.add_argument("--no-progress", action="store_true", help="no progress bar")
    pl.set_defaults(func=cmd_plot)

    sm = sub.add_parser("simulate", help="make a scheduler trace with the v1-like simulator",
                        description="Simulate a vLLM v1 scheduler serving a generated workload and write "
                                    "its steps as a trace.")
    add_settings(sm, options=False)
    sm.add_argument("--workload", choices=WORKLOAD_NAMES, default="chat", help="named workload")
    sm.add_argument("--seed", type=SEED, default=0, help="random seed")
    sm.add_argument("--num-requests", type=POSITIVE, default=None, help="requests (default: the workload's)")
    sm.add_argument("--arrival-rate", type=float_in(0.0, 1e6), default=None,
                    help="new requests per step, 0 = all at once")
    sm.add_argument("--max-steps", type=POSITIVE, default=None, help="stop after this many steps")
    sm.add_argument("--no-prefix-caching", action="store_true", help="disable prefix caching")
    sm.add_argument("-o", "--output", type=output_path, required=True, help="trace file to write (.jsonl or .jsonl.gz)")
    sm.add_argument("--no-progress", action="store_true", help="no progress bar")
    sm.set_defaults(func=cmd_simulate)


def size_names(text: str) -> str:
    """--margin-sizes: some of a bucket's size names (`bucket.SIZE_NAMES`), comma separated (as given, checked)."""
    from vllm_gaudi_unified.bucket import SIZE_NAMES

    names = [x.strip() for x in text.split(",") if x.strip()]
    if not names or set(names) - set(SIZE_NAMES):
        raise argparse.ArgumentTypeError(f"expected some of {', '.join(SIZE_NAMES)}, comma separated; got {text!r}")
    return ",".join(names)


def cmd_generate(args) -> int:

    t0 = time.perf_counter()
    plan = make_plan_from_args(args)
    plan.miss_policy = args.miss_policy
    plan.info["command"] = command_line(args)
    plan.save(args.output)
    extra = ""
    if "expected_padding_on_routes" in plan.info:
        extra = (f", padding {plan.info['expected_padding_on_routes']:.3f} on the routes a server takes over the "
                 f"{plan.info['steps']} steps learned from")
    elif "expected_padding_waste" in plan.info:
        extra = f", padding waste {plan.info['expected_padding_waste']:.3f} on {plan.info['steps']} steps learned from"
    if plan.info.get("prompt_steps"):
        extra += (f"; {len(plan.prompt_graphs)} prompt graphs take {plan.info['prompt_steps_on_prompt_graphs']} of "
                  f"the {plan.info['prompt_steps']} steps with prompts")
    print(f"wrote {args.output}: {plan.strategy} plan, {len(plan)} buckets{extra} ({time.perf_counter() - t0:.1f} s)")
    from vllm_gaudi_unified.bucket_plans.memory import warmup_memory

    print(warmup_memory(plan).describe())
    return 0


def make_plan_from_args(args):
    """The plan `buckets generate` makes (everything but writing it)."""
    from dataclasses import replace

    from vllm_gaudi_unified.bucket_plans.bucket_plan import gather_cap_for
    from vllm_gaudi_unified.bucket_plans.cost import Hardware
    from vllm_gaudi_unified.bucket_plans.exponential import exponential_plan
    from vllm_gaudi_unified.tools.robust import load_scaled_shapes, robust_plan
    from vllm_gaudi_unified.tools.shapes import StepShapes
    from vllm_gaudi_unified.tools.strategies import trace_plan

    settings = settings_from_args(args)
    model = model_from_args(args)
    hardware = Hardware() if args.device_memory_gb is None else replace(Hardware(), memory_gb=args.device_memory_gb)
    share = args.memory_share if args.memory_share is not None else (
        DEFAULT_MEMORY_SHARE if args.strategy == "robust" else None)
    cap = None
    if share is not None and not settings.options.batch_invariant:  # invariant products are chunked already
        cap = gather_cap_for(settings, model, hardware, share)
    if args.strategy == "exponential":
        plan = exponential_plan(settings, model, hardware, base=args.exp_base, cap=cap)
        return with_prompt_graphs(plan, learning_traces(args, settings) if args.prompt_graphs else [], args)
    traces = learning_traces(args, settings)
    parts, sources, probe, splits = off_prompt_graphs(traces, settings, cap, args)
    if args.strategy == "trace":
        max_graphs = args.max_graphs if args.max_graphs is not None else (None if args.target_waste else 32)
        plan = trace_plan(StepShapes.concat(parts), settings, model, hardware, max_graphs=max_graphs,
                          target_waste=args.target_waste, resolution=args.resolution,
                          margin=0.2 if args.margin is None else args.margin, progress=not args.no_progress)
        if cap is not None:
            raise ValueError("--memory-share is for the robust and exponential strategies")
        return with_graphs_again(plan, probe, traces, args, splits)
    fractions = [float(x) for x in args.load_fractions.split(",") if x.strip()]
    scaled = [x for src in sources for x in load_scaled_shapes(src, settings, fractions, drain=True)]
    weights = [1.0] * len(parts) + [args.load_weight * len(parts) / max(len(scaled), 1)] * len(scaled)
    plan = robust_plan(parts + scaled, settings, model, hardware,
                       max_graphs=DEFAULT_ROBUST_GRAPHS if args.max_graphs is None else args.max_graphs, worst=args.worst,
                       skeleton_ratio=args.skeleton_ratio, resolution=args.resolution,
                       margin=0.1 if args.margin is None else args.margin, cap=cap, source_weights=weights,
                       margin_sizes=None if args.margin_sizes is None else args.margin_sizes.split(","))
    from vllm_gaudi_unified.tools.evaluate import evaluate

    learned = StepShapes.concat([s for s, _ in traces])
    seen = evaluate(plan, learned)  # on the steps of the traces themselves (every one on the tiled route, as
    # `buckets evaluate` pads them)
    plan.info["steps"], plan.info["load_scaled_steps"] = len(learned), int(sum(len(x) for x in scaled))
    plan.info["expected_padding_waste"] = round(seen.padding_time, 4)
    plan.info["expected_padding_pairs"] = round(seen.padding_pairs, 4)
    return with_graphs_again(plan, probe, traces, args, splits)


def with_graphs_again(plan, probe, traces, args, splits=None):
    """`plan` with the prompt graphs learned again, against the buckets a step left to the tiled route
    really pads to, and the top graphs (the probe of `off_prompt_graphs` has none); its padding on the routes
    (`with_route_padding`, the steps' `splits` where found)."""
    graphs = with_prompt_graphs(plan, traces, args) if probe.prompt_graphs else graphs_of(probe, plan)
    return with_route_padding(graphs, traces, splits)


def command_line(args) -> str:
    """The `buckets generate` command that makes this plan again: --preset, --strategy and every
    flag that differs from its default, in the parser's order (not --jobs or --no-progress,
    which do not change the plan)."""
    import shlex

    words = ["vllm-gaudi-unified", "buckets", "generate"]
    for action in args._parser._actions:
        if not action.option_strings or action.dest in ("help", "jobs", "no_progress"):
            continue
        value = getattr(args, action.dest, None)
        if value in (None, []) or (value == action.default and action.dest not in ("preset", "strategy")):
            continue
        flag = max(action.option_strings, key=len)
        if isinstance(action, argparse._StoreTrueAction):
            words.append(flag)
        elif isinstance(value, list):
            for v in value:
                words += [flag, str(v)]
        else:
            words += [flag, str(value)]
    return " ".join(shlex.quote(w) for w in words)


def cmd_show(args) -> int:
    from vllm_gaudi_unified.bucket_plans.bucket_plan import BucketPlan

    plan = BucketPlan.load(args.plan)
    if args.json:
        print(json.dumps(plan.to_dict(), indent=1))
        return 0
    print(format_plan(plan))
    return 0


def format_plan(plan) -> str:
    s = plan.settings
    lines = [f"{plan.strategy or 'plan'}: {len(plan)} buckets, miss policy {plan.miss_policy!r}",
             f"settings: block_size {s.block_size}, max_num_seqs {s.max_num_seqs}, max_num_batched_tokens "
             f"{s.max_num_batched_tokens}, max_model_len {s.max_model_len}, num_blocks {s.num_blocks}"
             + (f", sliding_window {s.sliding_window}" if s.sliding_window else ""),
             f"planner: causal_tile {s.options.causal_tile}, shared_rows {s.options.shared_rows}, shared_tile_keys "
             f"{s.options.shared_tile_keys}, unique_layout {s.options.unique_layout}",
             "",
             f"{'#':>4} {'phase':<5} {'query':>7} {'causal':>7} {'shared':>7} {'unique':>7} {'logits':>7} {'work µs':>10}"]
    for i, (b, c) in enumerate(zip(plan.buckets, plan.costs)):
        lines.append(f"{i:>4} {b.phase:<5} {b.query_len:>7} {b.num_causal_tiles:>7} {b.num_shared_blocks:>7} "
                     f"{b.num_unique_blocks:>7} {b.num_logits:>7} {c:>10.1f}")
    if "expected_padding_waste" in plan.info:
        lines.append(f"padding waste on the {plan.info.get('steps')} steps it was made from: "
                     f"{plan.info['expected_padding_waste']:.3f} (every step in a bucket)"
                     + (f", {plan.info['expected_padding_on_routes']:.3f} on the routes a server takes"
                        if "expected_padding_on_routes" in plan.info else ""))
    if plan.prompt_graphs:
        lines += ["", f"prompt graphs ({len(plan.prompt_graphs)}): a bucket and its prompt route's shape, prompts x "
                      "rows x context blocks (other steps with prompts run on the tiled route)"]
        lines += [f"{i:>4} {b}" for i, b in enumerate(plan.prompt_graphs)]
        if plan.info.get("prompt_steps"):
            lines.append(f"they take {plan.info['prompt_steps_on_prompt_graphs']} of the {plan.info['prompt_steps']} "
                         "steps with prompts they were learned from")
    from vllm_gaudi_unified.bucket_plans.memory import warmup_memory

    lines += ["", f"{len(plan) + len(plan.prompt_graphs)} graphs; " + warmup_memory(plan).describe()]
    return "\n".join(lines)


def cmd_evaluate(args) -> int:
    from vllm_gaudi_unified.bucket_plans.bucket_plan import BucketPlan
    from vllm_gaudi_unified.bucket_plans.prompt_graphs import padding_on_routes, prompt_shapes
    from vllm_gaudi_unified.bucket_plans.trace import read_trace
    from vllm_gaudi_unified.tools.evaluate import evaluate
    from vllm_gaudi_unified.tools.shapes import shapes_of_steps, shapes_of_trace
    from vllm_gaudi_unified.tools.upstream import evaluate_upstream, upstream_tuples_of_trace
    from vllm_gaudi_unified.step_parts import in_parts, padding_in_parts

    plan = BucketPlan.load(args.plan)
    if args.upstream and plan.settings.options.batch_invariant:
        raise ValueError("--upstream compares default-mode plans (the earlier scheme had no invariant mode)")
    if args.steps and args.upstream:
        raise ValueError("--steps and --upstream: the earlier plan is scored on whole traces only")
    results, upstream, prompts = [], [], []
    for t in args.trace:
        window = read_trace(t).steps[slice(*args.steps)] if args.steps else None
        if window is not None:
            shapes = shapes_of_steps(window, plan.settings, f"{t}[{args.steps[0]}:{args.steps[1]}]")
        else:
            shapes = shapes_of_trace(t, plan.settings, jobs=args.jobs, progress=not args.no_progress)
        results.append(evaluate(plan, shapes, os.path.basename(t)))
        if plan.prompt_graphs:
            steps = window if window is not None else read_trace(t).steps
            routes = (padding_in_parts if in_parts(plan) else padding_on_routes)(plan, steps)
            found = [plan.prompt_graph(s) is not None for s in prompt_shapes(plan, steps)] if not in_parts(plan) else \
                [True] * routes["parts"]["steps"] + [False] * routes["tiled"]["steps"]
            prompts.append({"trace": os.path.basename(t), "steps_with_prompts": len(found),
                            "on_prompt_graphs": int(sum(found)), "routes": routes})
        if args.upstream:
            upstream.append(evaluate_upstream(plan.settings, plan.cost_model, upstream_tuples_of_trace(t, plan.settings),
                                              float(shapes.needed.sum()), os.path.basename(t)))
    print(f"plan: {args.plan} ({plan.strategy}, {len(plan)} graphs, gather cap {plan.gather_cap})\n")
    print("\n\n".join(r.table() for r in results))
    for p in prompts:
        print(f"\nprompt graphs on {p['trace']}: {p['on_prompt_graphs']} of the {p['steps_with_prompts']} steps with "
              f"prompts run in one of the plan's {len(plan.prompt_graphs)} (the others, and the padding above, "
              "on the tiled route)")
        r = p["routes"]
        how = "step_parts.plan_parts" if "parts" in r else "BucketPlan.route"
        print(f"padding, time model, on the routes a server takes ({how}): {r['padding']:.3f}; "
              + ", ".join(f"{k} steps {r[k]['steps']}: {r[k]['padded_us'] / max(r[k]['unpadded_us'], 1e-9):.3f}"
                          for k in ("decode", "parts" if "parts" in r else "graph", "tiled"))
              + f"; {r['skipped']} steps left out")
    for u in upstream:
        print(f"\nupstream plan on {u['trace']}: {u['graphs']} graphs, uncovered {u['uncovered']} (run unpadded), "
              f"padding time {u['padding_time']:.3f} / score pairs {u['padding_pairs']:.3f}, worst step "
              f"{u['worst_time']:.2f} / {u['worst_pairs']:.2f}, p99 {u['p99_time']:.2f} / {u['p99_pairs']:.2f}; "
              f"algorithm factor {u['algorithm_factor']:.3f}, with padding {u['total_factor']:.3f}")
    if args.json:
        with atomic_write(args.json) as f:
            json.dump({"plan": args.plan, "strategy": plan.strategy, "graphs": len(plan),
                       "results": [r.to_dict() for r in results], "upstream": upstream, "prompt_graphs": prompts},
                      f, indent=1)
    return 0


def cmd_plot(args) -> int:
    from vllm_gaudi_unified.bucket_plans.bucket_plan import BucketPlan
    from vllm_gaudi_unified.tools.plot import plot_plan
    from vllm_gaudi_unified.tools.shapes import shapes_of_trace

    plan = BucketPlan.load(args.plan)
    shapes = shapes_of_trace(args.trace, plan.settings, jobs=args.jobs, progress=not args.no_progress)
    plot_plan(plan, shapes, args.output)
    print(f"wrote {args.output}")
    return 0


def cmd_simulate(args) -> int:
    from vllm_gaudi_unified.bucket_plans.simulator import SchedulerConfig, Simulator, header_for
    from vllm_gaudi_unified.bucket_plans.workloads import workload_from
    from vllm_gaudi_unified.bucket_plans.trace import TraceWriter

    s = settings_from_args(args)
    sched = SchedulerConfig.from_settings(s, enable_prefix_caching=not args.no_prefix_caching,
                                          draft_acceptance=args.draft_acceptance)
    work = workload_from(args.workload, num_requests=args.num_requests, arrival_rate=args.arrival_rate)
    from tqdm import tqdm

    sim = Simulator(sched, work, args.seed)
    # The step count is not known ahead (requests arrive and finish): a counting bar, no total.
    with TraceWriter(args.output, header=header_for(sched, work, args.seed, args.workload)) as w, \
            tqdm(desc="simulating", unit="step", disable=args.no_progress) as bar:
        for step in sim.steps(args.max_steps):
            w.write(step)
            bar.update(1)
    print(f"wrote {args.output}: {w.num_steps} steps, {len(sim.finished)} requests finished, "
          f"{sim.num_preemptions} preemptions")
    return 0
