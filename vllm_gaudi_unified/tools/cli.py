"""The `vllm-gaudi-unified` command.

Each subcommand lives in its own module, which exposes `register(subparsers)`;
the module is imported only to build the parser, and heavy imports (torch,
matplotlib) happen inside the command functions so `--help` stays fast.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

#: Modules that add subcommands, in the order `--help` lists them.
COMMAND_MODULES = (
    "vllm_gaudi_unified.tools.demo",
    "vllm_gaudi_unified.tools.buckets",
    "vllm_gaudi_unified.warmup",
    "vllm_gaudi_unified.tools.trace_stats",
    "vllm_gaudi_unified.vllm_plugin.serve",
)


PROG = "vllm-gaudi-unified"


class _ShowRanges:
    """Help-formatter mixin: a range-checked flag's help ends with its range (`flags.CheckedType`), so the
    `--help` that an error points to says which values are accepted."""

    def _get_help_string(self, action):
        text = super()._get_help_string(action)
        describe = getattr(action.type, "describe", None)
        if text and text is not argparse.SUPPRESS and describe is not None:
            text += f" (range {describe()})"
        return text


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors: `vllm-gaudi-unified buckets generate: error: argument --margin: ...`
    (no usage block; `--help` has it), and numeric flags' ranges in `--help`. Subcommand parsers are of
    this class too."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")

    def _get_formatter(self):
        cls = self.formatter_class
        return type(f"Ranges{cls.__name__}", (_ShowRanges, cls), {})(prog=self.prog)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog=PROG,
        description="Unified Attention for vLLM on Intel Gaudi: demo, bucket plans, warmup, serving (and vLLM's "
                    "own commands). Benchmarks: python -m benchmarks.speed from a source checkout.",
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
    """Parse, run the command, and turn every failure into one line on stderr (the one error handler).

    Bad input (a `ValueError`: bad values, files that are not traces or plans; an `OSError`: missing,
    unreadable or unwritable files) -> `vllm-gaudi-unified: error: ...`, exit 2 (`-v` re-raises, for
    the traceback). Ctrl-C -> `vllm-gaudi-unified: interrupted`, exit 130. A closed pipe
    (`... | head`) -> no message, exit 1. Outputs are written atomically (`files.py`), so none of these
    leaves half a file behind."""
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] in (["serve"], ["vllm"]) and argv[1:] not in (["-h"], ["--help"]):
        args = parser.parse_args(argv[:1])  # the rest is vLLM's, flags first included (argparse's
        args.vllm_args = argv[1:]  # REMAINDER cannot start with a flag)
    else:
        args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    from vllm_gaudi_unified.log import setup_cli_logging

    setup_cli_logging(args.verbose)
    try:
        code = int(args.func(args) or 0)
        sys.stdout.flush()  # a closed pipe shows up here, not at exit
        return code
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)  # Python would complain again when flushing at exit
        os.dup2(devnull, sys.stdout.fileno())
        return 1
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except (ValueError, OSError, EOFError) as exc:
        if args.verbose:
            raise
        print(f"{PROG}: error: {describe(exc)}", file=sys.stderr)
        return 2


def describe(exc: BaseException) -> str:
    """One line for an error: `path: reason` for OS errors, the message otherwise."""
    if isinstance(exc, OSError) and exc.filename is not None:
        return f"{exc.filename}: {exc.strerror or exc}"
    text = str(exc) or type(exc).__name__
    return " ".join(text.split())


if __name__ == "__main__":
    sys.exit(main())
