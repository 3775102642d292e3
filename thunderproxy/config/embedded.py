"""The embedded simulator's settings: ``--sim``/``[sim]`` knob overrides checked against
``SimConfig``, and the ``THUNDERPROXY_SIM_*`` variables ``serve`` reads for its simulator.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from ..errors import ConfigError
from .settings import (
    ENV_PREFIX,
    FrozenMap,
    _suggest,
)

# --- loading --------------------------------------------------------------------------------


#: The prefix of the ``thunderproxy sim`` variables, which ``serve`` reads for its simulator.
SIM_ENV_PREFIX = ENV_PREFIX + "SIM_"


def sim_overrides(value: Any, origin: str) -> FrozenMap[str, Any]:
    """The embedded simulator's settings, by ``SimConfig`` field name, from ``NAME=VALUE``
    pairs (flags, variables) or a mapping (a ``[sim]`` table, code); every problem is a
    ConfigError naming where it came from and what the setting takes."""
    # Imported here: the simulator's package is large and only this check needs it.
    from ..sim.config import EMBEDDED, SimConfig, knob_value

    pairs: list[tuple[str, Any]] = []
    if isinstance(value, Mapping):
        pairs = list(value.items())
    else:
        for pair in (value,) if isinstance(value, str) else value:
            name, sep, raw = str(pair).partition("=")
            if not sep:
                raise ConfigError(
                    f"{origin} {pair!r}: expected NAME=VALUE, e.g. --sim max_model_len=262144."
                )
            pairs.append((name, raw.strip()))
    known = [f.name for f in dataclasses.fields(SimConfig)]
    out: dict[str, Any] = {}
    for name, raw in pairs:
        key = name.strip().replace("-", "_")
        if key not in known:
            raise ConfigError(
                f"{origin}: {name!r} is not a `thunderproxy sim` setting; {_suggest(key, known)}"
            )
        try:
            out[key] = knob_value(key, raw)
        except ValueError as exc:
            raise ConfigError(f"{origin}: {exc}.") from None
    try:
        SimConfig(**{**EMBEDDED, **out})
    except ValueError as exc:
        raise ConfigError(f"{origin}: {exc}.") from None
    return FrozenMap(out)


def sim_environment(environ: Mapping[str, str]) -> tuple[str, ...]:
    """The ``THUNDERPROXY_SIM_<NAME>`` variables that name simulator settings, as ``NAME=VALUE``
    pairs (``thunderproxy sim``'s own HOST and PORT are not settings of the simulator)."""
    from ..sim.config import SimConfig

    known = {f.name for f in dataclasses.fields(SimConfig)}
    pairs = []
    for variable, value in sorted(environ.items()):
        name = variable.removeprefix(SIM_ENV_PREFIX).lower()
        if variable.startswith(SIM_ENV_PREFIX) and name in known:
            pairs.append(f"{name}={value}")
    return tuple(pairs)
