"""Draw the ``--sweep`` plot from the ``--json`` files of several bench runs (one run per
concurrency or per group of targets), so a long sweep can run as pieces that each keep their
figures when another is stopped.

    python scripts/sweep_plot.py OUT.png RUN.json [RUN.json ...] [--title TITLE]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from thunderproxy.bench.report.plot import sweep_plot


def results(paths: list[str]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for path in paths:
        doc = json.loads(Path(path).read_text())
        out += doc["results"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("runs", nargs="+")
    parser.add_argument("--title", default="")
    args = parser.parse_args()
    sweep_plot(results(args.runs), args.out, title=args.title)


if __name__ == "__main__":
    main()
