"""``GET /programs`` in pages: ``?limit=``, ``?after=<cursor>``, ``?state=``, ``?backend=``,
``?model=``.

A page is an object keyed by program id, in creation order; when more follow,
the response names the next page in ``Link: <...>; rel="next"`` and ``X-Next-Cursor``. The cursor
is the registry's creation sequence number of the last program looked at, so releases between
two pages neither skip nor repeat a program; treat it as opaque.

A page costs a bisection to find the cursor plus the programs it looks at: at most ``limit``
without a filter, at most ``SCAN_PER_ITEM * limit`` with one (a filtered page may then hold fewer
than ``limit`` programs and still name a next page).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlencode

from ...errors import InvalidRequest
from ...programs import Program, ProgramStatus
from ...programs.registry import ProgramRegistry
from ..validate import parse_integer

DEFAULT_LIMIT = 1000
MAX_LIMIT = 10_000
#: Programs a filtered page may look at per program it can return.
SCAN_PER_ITEM = 16
#: The view's ``status`` of an acting program presumed ended (programs/ending.py): silent for
#: longer than its tool gaps explain, counted as released, until a call of it comes back.
ENDED = "ended"
#: Values of ``?state=``: the view's ``status`` (reasoning, acting, ended, paused) or ``state``
#: (active).
STATES = frozenset({*(s.value for s in ProgramStatus), ENDED, "active", "terminated"})


def view_status(program: Program) -> str:
    """What ``/programs`` calls a program's status: a finished session that nobody released is
    ``ended`` once presumed so, not ``acting`` until its idle lease retires it minutes later."""
    if program.status is ProgramStatus.REASONING:
        return "reasoning"
    return ENDED if program.presumed_ended else "acting"


@dataclass(frozen=True)
class ProgramQuery:
    limit: int = DEFAULT_LIMIT
    after: int | None = None
    state: str | None = None
    backend: str | None = None
    model: str | None = None

    @property
    def filtered(self) -> bool:
        return self.state is not None or self.backend is not None or self.model is not None

    def keeps(self, program: Program) -> bool:
        if self.backend is not None and program.backend != self.backend:
            return False
        if self.model is not None and program.model != self.model:
            return False
        if self.state is None:
            return True
        if self.state in ("acting", ENDED):
            return program.status is not ProgramStatus.PAUSED and self.state == view_status(program)
        return self.state in (program.status.value, program.status.lifecycle)


@dataclass(frozen=True)
class Page:
    programs: list[Program]
    #: The ``after`` value of the next page; None on the last one.
    next_cursor: str | None


def parse_query(args: Mapping[str, str]) -> ProgramQuery:
    """The query string of ``GET /programs``; an invalid value is a 400 naming the parameter."""
    limit = DEFAULT_LIMIT
    if "limit" in args:
        limit = parse_integer(args["limit"], "limit", low=1, high=MAX_LIMIT)
    after = None
    if args.get("after"):
        # A cursor is a sequence number the proxy handed out (X-Next-Cursor).
        after = parse_integer(args["after"], "after")
    state = args.get("state") or None
    if state is not None and state not in STATES:
        raise InvalidRequest(
            f"state must be one of {', '.join(sorted(STATES))}, got {state!r}.", param="state"
        )
    return ProgramQuery(
        limit=limit,
        after=after,
        state=state,
        backend=args.get("backend") or None,
        model=args.get("model") or None,
    )


def page(registry: ProgramRegistry, query: ProgramQuery) -> Page:
    """One page of programs in creation order, with the cursor of the next page."""
    budget = query.limit * SCAN_PER_ITEM if query.filtered else query.limit
    found: list[Program] = []
    last_seen: int | None = None
    for seq, program in registry.after(query.after):
        if len(found) == query.limit or budget == 0:
            # Something follows what this page looked at: name the next page.
            return Page(found, None if last_seen is None else str(last_seen))
        budget -= 1
        last_seen = seq
        if query.keeps(program):
            found.append(program)
    return Page(found, None)


def next_link(path: str, args: Mapping[str, str], cursor: str) -> str:
    """The ``Link`` header value naming the next page, keeping the other parameters."""
    params = {k: v for k, v in args.items() if k != "after"}
    params["after"] = cursor
    return f'<{path}?{urlencode(params)}>; rel="next"'
