"""The ``[limits]`` config section as values: limits per model, program classes, defaults.

The section's rules sit beside the values they build; admission/ reads the values, and
sections.py registers :func:`parse_limits` under ``[limits]``. Every problem is a ConfigError
that names the key and the remedy.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..where import Where

#: The limit names of one model, as written in the file.
LIMIT_KEYS = ("rpm", "tpm", "rpd", "tpd", "concurrent")
CLASS_KEYS = ("ratio", "flexible", "max_wait")
TOP_KEYS = ("default_class", "completion_tokens", "models", "backends", "clients", "classes")
#: A call that names no class and a config that lists none: one class with all the capacity.
DEFAULT_CLASS = "default"


@dataclass(frozen=True)
class ModelLimits:
    """Limits of one model group (None: unlimited). Tokens are prompt + completion."""

    rpm: int | None = None
    tpm: int | None = None
    rpd: int | None = None
    tpd: int | None = None
    concurrent: int | None = None


@dataclass(frozen=True)
class ClassSpec:
    """A program class: its share of every model's capacity, whether it lends and borrows
    unused capacity (flexible) or keeps exactly its share (fixed), and how long its calls may
    wait for capacity before a 429 (or, for an alias, before falling back)."""

    name: str
    ratio: float
    flexible: bool = True
    max_wait_s: float = 30.0


@dataclass(frozen=True)
class LimitsSpec:
    models: Mapping[str, ModelLimits] = field(default_factory=dict)
    classes: tuple[ClassSpec, ...] = (ClassSpec(DEFAULT_CLASS, 1.0),)
    default_class: str = DEFAULT_CLASS
    #: Completion tokens reserved for a call that sets no max_tokens, until a model's completions
    #: have been measured.
    completion_tokens: int = 256
    #: Limits of single backends, by URL or name (``[limits.backends.<name>]``): what one
    #: deployment allows, whichever model group sends to it. Not split among classes.
    backends: Mapping[str, ModelLimits] = field(default_factory=dict)
    #: Limits of single clients (``[limits.clients.<name>]``, a name from ``[clients]``): what
    #: one client may use of every model and backend together. Not split among classes.
    clients: Mapping[str, ModelLimits] = field(default_factory=dict)

    def __hash__(self) -> int:
        return hash(
            (
                tuple(sorted(self.models.items())),
                tuple(sorted(self.backends.items())),
                tuple(sorted(self.clients.items())),
                self.classes,
                self.default_class,
            )
        )

    def klass(self, name: str) -> ClassSpec | None:
        return next((c for c in self.classes if c.name == name), None)

    def public(self) -> dict[str, Any]:
        return {
            "default_class": self.default_class,
            "completion_tokens": self.completion_tokens,
            "models": {
                name: {k: getattr(lim, k) for k in LIMIT_KEYS if getattr(lim, k) is not None}
                for name, lim in self.models.items()
            },
            "backends": {
                name: {k: getattr(lim, k) for k in LIMIT_KEYS if getattr(lim, k) is not None}
                for name, lim in self.backends.items()
            },
            "clients": {
                name: {k: getattr(lim, k) for k in LIMIT_KEYS if getattr(lim, k) is not None}
                for name, lim in self.clients.items()
            },
            "classes": {
                c.name: {"ratio": c.ratio, "flexible": c.flexible, "max_wait": c.max_wait_s}
                for c in self.classes
            },
        }


def _unknown(table: Mapping[str, Any], known: tuple[str, ...], where: Where) -> None:
    for key in table:
        if key not in known:
            hint = key.replace("-", "_")
            remedy = (
                f"did you mean {hint!r}?" if hint in known else "known keys: " + ", ".join(known)
            )
            raise where.dot(key).error("unknown key", remedy)


def _table(value: Any, where: Where, example: str) -> Mapping[str, Any]:
    if not isinstance(value, dict):
        raise where.error(f"expected a table, got {type(value).__name__}", f"write {example}")
    return value


def _count(value: Any, where: Where) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise where.error(
            f"expected a positive integer, got {value!r}",
            "write a whole number above 0, or leave the key out for no limit",
        )
    return value


def _model(value: Any, where: Where) -> ModelLimits:
    table = _table(value, where, "a table like { rpm = 600, tpm = 200000 }")
    _unknown(table, LIMIT_KEYS, where)
    if not table:
        raise where.error("no limits given", "set at least one of " + ", ".join(LIMIT_KEYS))
    return ModelLimits(**{k: _count(v, where.dot(k)) for k, v in table.items()})


def _class(name: str, value: Any, where: Where) -> ClassSpec:
    table = _table(value, where, "a table like { ratio = 0.5, flexible = true, max_wait = 30 }")
    _unknown(table, CLASS_KEYS, where)
    ratio = table.get("ratio")
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
        raise where.dot("ratio").error(
            f"expected a number in (0, 1], got {ratio!r}",
            "give each class its share of every model's capacity, e.g. ratio = 0.3",
        )
    flexible = table.get("flexible", True)
    if not isinstance(flexible, bool):
        raise where.dot("flexible").error(f"expected true or false, got {flexible!r}", "fix it")
    wait = table.get("max_wait", 30.0)
    if isinstance(wait, bool) or not isinstance(wait, (int, float)) or wait < 0:
        raise where.dot("max_wait").error(
            f"expected seconds >= 0, got {wait!r}", "write e.g. max_wait = 30 (0: never wait)"
        )
    return ClassSpec(name, float(ratio), flexible, float(wait))


def most_of(klass: ClassSpec, classes: tuple[ClassSpec, ...]) -> float:
    """The largest part of a model's capacity ``klass`` can ever use: its ratio, plus, when
    flexible, every other flexible class's ratio lent whole."""
    if not klass.flexible:
        return klass.ratio
    return sum(c.ratio for c in classes if c.flexible)


def _check_reachable(
    models: Mapping[str, ModelLimits], classes: tuple[ClassSpec, ...], where: Where
) -> None:
    """Refuse a class that could never be admitted a call of a limited model: its most of a
    limit below one request (rpm, rpd, concurrent) or one token (tpm, tpd). Such a call would
    only ever wait out its ``max_wait``; this instance alone is assumed (with several, each
    has 1/n of every limit, and a call that cannot fit then is refused at once)."""
    for name, limits in models.items():
        for klass in classes:
            most = most_of(klass, classes)
            for key in LIMIT_KEYS:
                limit = getattr(limits, key)
                if limit is None or limit * most >= 1 - 1e-9:
                    continue
                unit = "token" if key in ("tpm", "tpd") else "call"
                kind = "flexible, borrowing all it can" if klass.flexible else "fixed"
                other = "the class's ratio" + ("" if klass.flexible else " (or make it flexible)")
                raise (
                    where.dot("classes")
                    .dot(klass.name)
                    .dot("ratio")
                    .error(
                        f"class {klass.name!r} ({kind}) can never be admitted a call of {name}: "
                        f"{most:g} of limits.models.{name}.{key} = {limit} is {limit * most:g}, "
                        f"less than one {unit}",
                        f"raise limits.models.{name}.{key} to at least "
                        f"{math.ceil(1 / most - 1e-9)}, or {other}",
                    )
                )


def check_served(spec: LimitsSpec, served: Collection[str], where: Where) -> None:
    """Refuse a ``[limits.models.<name>]`` that no backend serves, when every backend lists
    its models (the limits hold per served name, an alias's targets each by its own): such a
    limit would never apply."""
    for name in spec.models:
        if name not in served:
            raise (
                where.dot("models")
                .dot(name)
                .error(
                    f"{name!r} is served by no backend (served: {', '.join(sorted(served))})",
                    "use a served model name (an alias's targets each have their own limits), or "
                    "add it to a [[backends]] models list",
                )
            )


def parse_limits(value: Any, where: Where) -> Mapping[str, Any]:
    """``[limits]``: ``[limits.models.<name>]``, ``[limits.backends.<url or name>]`` and
    ``[limits.clients.<name>]`` tables of rpm/tpm/rpd/tpd/concurrent,
    ``[limits.classes.<name>]`` tables of ratio/flexible/max_wait, ``default_class``."""
    table = _table(value, where, "[limits] with [limits.models.<model>] tables")
    _unknown(table, TOP_KEYS, where)
    models_in = _table(table.get("models", {}), where.dot("models"), "[limits.models.<model>]")
    models = {name: _model(v, where.dot("models").dot(name)) for name, v in models_in.items()}
    backends_in = _table(
        table.get("backends", {}), where.dot("backends"), '[limits.backends."<url or name>"]'
    )
    backends = {name: _model(v, where.dot("backends").dot(name)) for name, v in backends_in.items()}
    clients_in = _table(table.get("clients", {}), where.dot("clients"), "[limits.clients.<name>]")
    clients = {name: _model(v, where.dot("clients").dot(name)) for name, v in clients_in.items()}
    classes_in = _table(table.get("classes", {}), where.dot("classes"), "[limits.classes.<name>]")
    classes = tuple(_class(n, v, where.dot("classes").dot(n)) for n, v in classes_in.items())
    if not classes:
        classes = (ClassSpec(DEFAULT_CLASS, 1.0),)
    total = sum(c.ratio for c in classes)
    if abs(total - 1.0) > 1e-6:
        raise where.dot("classes").error(
            f"the ratios add up to {total:g}, not 1",
            "give the classes ratios that sum to 1, so every model's capacity is shared out",
        )
    names = [c.name for c in classes]
    default = table.get("default_class", names[0])
    if default not in names:
        raise where.dot("default_class").error(
            f"{default!r} is not a class", "name one of: " + ", ".join(names)
        )
    completion = _count(table.get("completion_tokens", 256), where.dot("completion_tokens"))
    _check_reachable(models, classes, where)
    spec = LimitsSpec(models, classes, default, completion, backends, clients)
    return {"limits": spec}
