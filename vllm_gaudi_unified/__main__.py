"""The console command `vllm-gaudi-unified` and `python -m vllm_gaudi_unified`: a thin entry.

The SIGINT handler goes in before anything heavy is imported (the command
modules pull in numpy, torch, matplotlib or vLLM, which take seconds), so a
Ctrl-C at any moment, during those imports too, ends as one line,
`vllm-gaudi-unified: interrupted`, and exit status 130, never a traceback.
The first Ctrl-C raises KeyboardInterrupt (so `finally` blocks and atomic
writes clean up); further ones during that clean-up are ignored. A SIGINT that
the parent process ignores (a background job) stays ignored, as Python does.
"""
import signal
import sys

PROG = "vllm-gaudi-unified"
INTERRUPTED = 130


def _on_sigint(signum, frame):
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not break the clean-up
    raise KeyboardInterrupt


def _say_interrupted() -> int:
    try:
        sys.stderr.write(f"{PROG}: interrupted\n")
        sys.stderr.flush()
    except (OSError, ValueError):  # stderr closed: the exit status still says it
        pass
    return INTERRUPTED


def main(argv=None) -> int:
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _on_sigint)
    try:
        from vllm_gaudi_unified.tools.cli import main as run

        return run(argv)
    except KeyboardInterrupt:
        return _say_interrupted()


if __name__ == "__main__":
    sys.exit(main())
