"""One logger for the package: vLLM's when running inside vLLM, plain logging otherwise."""
from __future__ import annotations

import logging
import sys


def get_logger(name: str) -> logging.Logger:
    """vLLM's `init_logger` when vLLM is already imported (so our lines follow its format
    and level settings), else a standard logger. Never imports vLLM itself."""
    if "vllm" in sys.modules:
        try:
            from vllm.logger import init_logger

            return init_logger(name)
        except Exception:  # pragma: no cover - a vLLM without init_logger
            pass
    return logging.getLogger(name)


def setup_cli_logging(verbose: bool) -> None:
    """The commands' log lines on stderr: this package's at INFO (DEBUG with -v), other libraries' only from
    WARNING (torch logs its cache statistics at INFO when the process exits)."""
    logging.basicConfig(level=logging.DEBUG if verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("vllm_gaudi_unified").setLevel(logging.DEBUG if verbose else logging.INFO)
