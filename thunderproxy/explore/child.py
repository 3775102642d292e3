"""The explorer's own process: ``serve`` starts it (``mount.py``) to run Datasette off the event
loop that relays every stream, and relays ``/datasette/`` to it over a Unix socket.

    python -m thunderproxy.explore.child --db DB --socket PATH --parent-pid PID

It serves Datasette on that socket on Hypercorn's trio worker through trio-asyncio (``server.py``),
the stack the proxy runs on, and writes ``ready`` on stdout once it listens and Datasette has
started. Only this process imports trio-asyncio. It never outlives the proxy: the
kernel kills it when the proxy's thread that started it ends (``PR_SET_PDEATHSIG``, Linux), and
elsewhere it exits once its stdin, a pipe only the proxy holds, reaches end of file. A query
stuck in one SQLite instruction past the time limit ends the process with ``EXIT_OVERRUN``
(``limits.QueryClock``): no thread can be stopped, and the proxy starts a fresh process.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import sys
import threading

#: The exit status that says a query overran its time limit inside one SQLite instruction.
EXIT_OVERRUN = 75
#: The exit status when the proxy that started this process is gone.
EXIT_ORPHANED = 76
#: ``prctl(2)``'s option that sends this process a signal when its parent's thread ends.
PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> None:
    """Have the kernel kill this process when the proxy ends; exit now if it already has."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass  # the stdin watch below still ends it
    # The proxy may have died before prctl: this process then has another parent already.
    if os.getppid() != parent_pid:
        os._exit(EXIT_ORPHANED)

    def watch_stdin() -> None:
        # Only the proxy holds the pipe's other end: end of file means it is gone.
        while os.read(0, 4096):
            pass
        os._exit(EXIT_ORPHANED)

    threading.Thread(target=watch_stdin, name="explore-parent", daemon=True).start()


def overrun(_seconds: float) -> None:
    sys.stderr.flush()
    os._exit(EXIT_OVERRUN)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="thunderproxy.explore.child")
    parser.add_argument("--db", required=True)
    parser.add_argument("--socket", required=True)
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--time-limit-ms", type=int, default=None)
    args = parser.parse_args(argv)
    die_with_parent(args.parent_pid)

    from .instance import SETTINGS, build_datasette
    from .limits import QueryClock
    from .server import hypercorn_config
    from .standalone import run_explorer

    limit_ms: int = args.time_limit_ms or SETTINGS["sql_time_limit_ms"]
    ds = build_datasette(args.db, QueryClock(limit_ms / 1000, overrun), time_limit_ms=limit_ms)
    config = hypercorn_config(
        f"unix:{args.socket}",
        # The relay sends every request on kept-alive connections; keep them past its pauses.
        keep_alive_s=60.0,
        # Within the proxy's wait between SIGTERM and SIGKILL (mount.STOP_GRACE_S).
        graceful_s=2.0,
    )

    def ready(_binds: list[str]) -> None:
        sys.stdout.write("ready\n")
        sys.stdout.flush()
        os.dup2(2, 1)  # nothing else goes to the pipe the proxy read "ready" from

    run_explorer(ds, config, ready)


if __name__ == "__main__":
    main()
