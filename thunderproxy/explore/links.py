"""Links into the explorer: the dashboard of one run, with a window and a bucket that fit it.

The canned time series pick the same bucket themselves when ``bucket`` is blank (see the header
of ``metadata.yaml``); a link states it, so that the page shows what the link promised even
after later runs were added to the db.
"""

from __future__ import annotations

from urllib.parse import urlencode

from .names import MOUNT_PATH

#: Bucket sizes in seconds, as the canned queries choose among them.
BUCKETS = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 10800, 21600, 86400)
#: Most rows a time series should have: enough to see a 30 s demo's shape, few enough to read.
MAX_ROWS = 30
#: The dashboard that draws the canned time series.
DASHBOARD = "-/dashboards/scheduling"


def bucket_for(span_s: float, poll_s: float = 0.0) -> int:
    """The smallest bucket that splits ``span_s`` seconds into at most ``MAX_ROWS`` rows and is
    no shorter than the metrics interval ``poll_s`` (a shorter one leaves buckets without a
    poll, breaking the KV chart's lines)."""
    for size in BUCKETS:
        if size * MAX_ROWS >= span_s and size >= poll_s:
            return size
    return BUCKETS[-1]


def dashboard_url(
    base: str, run_id: int, started: float, stopped: float | None, *, poll_s: float = 0.0
) -> str:
    """The scheduling dashboard of run ``run_id``: its window from ``started`` to ``stopped``
    (Unix seconds; None while it runs: no end, and the bucket is left to the queries, which fit
    it to the data shown) in a bucket that fits the run.

    ``base`` is the proxy's URL (``http://127.0.0.1:8300``) or the explorer's own
    (``.../datasette/``); ``poll_s`` the run's metrics interval, if known."""
    root = base.rstrip("/")
    if not root.endswith(MOUNT_PATH.rstrip("/")):
        root += MOUNT_PATH.rstrip("/")
    params = {
        "run_id": str(run_id),
        "since": f"{started:.3f}",
        # The window's end is exclusive: the run's last rows are written at its stop.
        "until": "" if stopped is None else f"{stopped + 0.001:.3f}",
        "bucket": "" if stopped is None else str(bucket_for(stopped - started, poll_s)),
    }
    return f"{root}/{DASHBOARD}?{urlencode(params)}"
