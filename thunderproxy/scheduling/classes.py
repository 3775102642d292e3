"""Latency classes: which bound a program's calls are held to, pure.

tr holds calls back so that the programs that run keep their cache, and the price is paid in
waits of up to ``--max-wait``. An agent that runs unattended gets that price back in program
time; a person at a terminal does not. So a program is in one of two classes:

- ``interactive``: its calls wait at most ``--interactive-max-wait`` (seconds), room is made
  for them from batch programs at once, and its idle cache is the last to be paused;
- ``batch``: its calls wait at most ``--max-wait``, as every call did before classes.

A call's class is, in order: the class it names (``program_class`` in the body or in
``extra_body``, else the ``X-Program-Class`` header; the same name ``[limits]`` reads), when it
is one of the two; ``interactive`` when the call came from a client a person drives, as
recognition tells (:data:`INTERACTIVE_SOURCES`); else the class its program already has; else
``--default-program-class``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from ..config.settings import PROGRAM_CLASSES

BATCH, INTERACTIVE = PROGRAM_CLASSES
#: The header a call names its class in (the body's ``program_class`` goes first).
CLASS_HEADER = "x-program-class"
#: Recognition sources (protocols/recognition.py's Source) that only a client a person drives
#: produces: Claude Code's session, Codex's session, and aider's way of editing its last turn
#: (``edited_prefix``: it appends a reminder to its newest message and drops it next turn).
#: aider's first call is recognised by nothing of its own: it is in the default class.
INTERACTIVE_SOURCES = frozenset({"claude_code", "codex", "edited_prefix"})


def named_class(body: Mapping[str, Any], headers: Iterable[tuple[str, str]]) -> str | None:
    """The class a call names, whatever it is: ``program_class`` in its body or
    ``extra_body``, else its ``X-Program-Class`` header (None: it names none)."""
    extra = body.get("extra_body")
    for source in (body, extra if isinstance(extra, dict) else {}):
        value = source.get("program_class")
        if isinstance(value, str) and value:
            return value
    for name, value in headers:
        if name.lower() == CLASS_HEADER and value:
            return value
    return None


def resolve(named: str | None, source: str | None, current: str | None, default: str) -> str:
    """A call's latency class: the one it names (a name that is no latency class, such as a
    ``[limits]`` class of another name, says nothing here), ``interactive`` for a recognised
    interactive client, else its program's (``current``), else ``default``."""
    if named in PROGRAM_CLASSES:
        return named
    if source in INTERACTIVE_SOURCES:
        return INTERACTIVE
    if current is not None:
        return current
    return default
