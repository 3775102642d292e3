"""Stopping without cutting anyone off: SIGTERM drains in two phases.

Handing SIGTERM straight to Hypercorn lost requests: its shutdown closes the listening socket,
which resets every connection still in the kernel's accept queue, and closes at once every
connection it considers idle, which includes one accepted but whose request head it has not
parsed yet. Clients whose requests were already on the wire got "connection reset" and no audit
row (94 of 200 streams in one run), or a stream cut and logged 499.

So the proxy drains first, with Hypercorn still serving (:func:`drain_then_stop` is its shutdown
trigger):

1. ``Drain.begin()``: every request that arrives from now on is answered at once with 503,
   ``Retry-After`` and ``Connection: close`` (a rejection row, never a reset); every request
   already in the app goes on to its end. This lasts until none is left, or ``--shutdown-grace``.
2. Hypercorn's own shutdown: it stops listening and closes the idle connections. Once the app
   has drained nothing is left to finish, so Hypercorn gets at most ``CLOSE_S`` for it rather
   than the rest of the grace. If the grace ran out first, what is still running is cancelled
   at once and logged 499.

Idle keep-alive connections used to hold the stop for the whole grace (20.4 s of a 20 s grace
with one idle client): see ``ProxyHTTPConnection`` in http/app.py for why Hypercorn's watcher
that closes them never ran behind quart-trio, and the fix.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import trio

#: Hypercorn's graceful timeout once the app has drained: enough to answer a request that
#: arrives on an idle connection in that instant (503), too short to notice.
CLOSE_S = 0.5


class Drain:
    """Counts the exchanges inside the app, and says whether the proxy is draining."""

    def __init__(self) -> None:
        self.draining = False
        self.in_flight = 0
        self._idle = trio.Event()
        self._idle.set()

    def begin(self) -> None:
        self.draining = True

    @contextmanager
    def exchange(self) -> Iterator[None]:
        """Held for as long as one HTTP exchange runs in the app (response body included)."""
        self.in_flight += 1
        if self.in_flight == 1:
            self._idle = trio.Event()
        try:
            yield
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self._idle.set()

    async def wait_idle(self) -> None:
        """Return once no exchange is running."""
        while self.in_flight:
            await self._idle.wait()


async def drain_then_stop(shutdown: trio.Event, drain: Drain, config: Any, grace: float) -> None:
    """Hypercorn's shutdown trigger: returns, starting Hypercorn's own shutdown, once
    ``shutdown`` is set and the app has drained (or ``grace`` seconds have passed)."""
    await shutdown.wait()
    deadline = trio.current_time() + grace
    drain.begin()
    with trio.move_on_at(deadline):
        await drain.wait_idle()
    # Hypercorn reads its graceful timeout when this returns; the whole stop stays within
    # --shutdown-grace.
    remaining = max(0.0, deadline - trio.current_time())
    config.graceful_timeout = min(CLOSE_S, remaining) if drain.in_flight == 0 else remaining
