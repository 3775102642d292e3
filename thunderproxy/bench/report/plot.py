"""The ``--sweep`` plot: steps/min and p99 program time against concurrency, one line per
target. matplotlib is optional (``pip install 'thunderproxy[plot]'``)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

from ...errors import ConfigError

MISSING = (
    "--sweep draws its plot with matplotlib, which is not installed; install the optional "
    "extra with: pip install 'thunderproxy[plot]' (or pass --no-plot)."
)


def series(results: Sequence[Mapping[str, Any]], key: str) -> dict[str, list[tuple[int, float]]]:
    """target -> [(concurrency, value)] sorted by concurrency, skipping missing values (pure)."""
    out: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for r in results:
        value = r.get(key)
        if value is not None:
            out[str(r["target"])].append((int(r["concurrency"]), float(value)))
    return {target: sorted(points) for target, points in out.items()}


def require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ConfigError(MISSING) from None


def sweep_plot(results: Sequence[Mapping[str, Any]], path: str, *, title: str = "") -> None:
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 7), sharex=True)
    for target, points in series(results, "steps_per_min").items():
        top.plot([c for c, _ in points], [v for _, v in points], marker="o", label=target)
    for target, points in series(results, "program_time_p99_s").items():
        bottom.plot([c for c, _ in points], [v for _, v in points], marker="o", label=target)
    top.set_ylabel("steps / min")
    bottom.set_ylabel("p99 program time (s)")
    bottom.set_xlabel("concurrency (agents)")
    for ax in (top, bottom):
        ax.set_xscale("log", base=2)
        ax.grid(True, alpha=0.3)
        ax.legend()
    concurrencies = sorted({int(r["concurrency"]) for r in results})
    bottom.set_xticks(concurrencies, [str(c) for c in concurrencies])
    if title:
        top.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
