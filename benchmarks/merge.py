"""Merge the `results.json` of several suite runs (e.g. block size 16 and 128 run in separate device calls)
into one results.json / results.md / results.png.

    python -m benchmarks.merge OUT_DIR RUN_DIR_OR_JSON [RUN_DIR_OR_JSON ...]

Rows are concatenated in order; the environment of the first run is kept and the dates of all are listed.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from benchmarks import report


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 2:
        raise SystemExit(__doc__)
    out, runs = Path(argv[0]), [Path(a) for a in argv[1:]]
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
