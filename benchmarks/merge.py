"""Merge the `results.json` of several suite runs (e.g. block size 16 and 128 run in separate device calls)
into one results.json / results.md / results.png.

    python -m benchmarks.merge OUT_DIR RUN_DIR_OR_JSON [RUN_DIR_OR_JSON ...]

Rows are concatenated in order; the environment of the first run is kept and the dates of all are listed.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks import report
from vllm_gaudi_unified.files import output_dir
from vllm_gaudi_unified.tools.cli import Parser


def main(argv=None) -> int:
    p = Parser(prog="python -m benchmarks.merge", description=__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=output_dir, metavar="OUT_DIR", help="folder for the merged results")
    p.add_argument("runs", nargs="+", metavar="RUN_DIR_OR_JSON", help="the runs' folders or results.json files")
    args = p.parse_args(argv)
    out, runs = Path(args.out), [Path(a) for a in args.runs]
    data = [json.loads((r / "results.json" if r.is_dir() else r).read_text()) for r in runs]
    env = dict(data[0]["env"])
    dates = [d["env"].get("date") for d in data]
    if len(set(dates)) > 1:
        env["date"] = " and ".join(dict.fromkeys(dates))
    rows = [row for d in data for row in d["rows"]]
    out.mkdir(parents=True, exist_ok=True)
    report.write_all(out, env, {"merged": [str(r) for r in runs]}, rows, plot=True)
    print(report.markdown(env, rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
