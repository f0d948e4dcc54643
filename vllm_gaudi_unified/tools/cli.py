"""The `vllm-gaudi-unified` command.

Each subcommand lives in its own module, which exposes `register(subparsers)`;
the module is imported only to build the parser, and heavy imports (torch,
matplotlib) happen inside the command functions so `--help` stays fast.
"""
from __future__ import annotations

import argparse
import importlib
import sys

#: Modules that add subcommands, in the order `--help` lists them.
COMMAND_MODULES = (
    "vllm_gaudi_unified.tools.demo",
    "vllm_gaudi_unified.tools.buckets",
    "vllm_gaudi_unified.warmup",
    "vllm_gaudi_unified.tools.trace_stats",
    "vllm_gaudi_unified.tools.bench",
    "vllm_gaudi_unified.vllm_plugin.serve",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vllm-gaudi-unified",
        description="Unified Attention for vLLM on Intel Gaudi: demo, bucket plans, warmup, benchmarks, serving.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at debug level")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:  # a real missing dependency inside the module
                raise
            continue
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    from vllm_gaudi_unified.log import setup_cli_logging

    setup_cli_logging(args.verbose)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
