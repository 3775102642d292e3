"""The structured sections of a ``--config`` TOML file (``[[backends]]``, ``[aliases]``,
``[limits]``), each parsed by the function registered for it in ``SECTIONS``, and the reading of
the file itself (docs/CONFIG.md). A new section registers here and adds its Settings field.
"""

from __future__ import annotations

import tomllib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..where import Where
from .clients import parse_clients
from .embedded import sim_overrides
from .limits import parse_limits
from .settings import (
    NO_DEFAULT_MODEL,
    SETTINGS_BY_NAME,
    BackendSpec,
    FrozenMap,
    Setting,
    Settings,
    _suggest,
)

# --- config-file sections -------------------------------------------------------------------


#: Parses one top-level section of a config file into Settings field values.
SectionParser = Callable[[Any, Where], Mapping[str, Any]]
#: Section name -> parser. A new section registers here (and adds its Settings field).
SECTIONS: dict[str, SectionParser] = {}


def section(name: str) -> Callable[[SectionParser], SectionParser]:
    def register(parser: SectionParser) -> SectionParser:
        SECTIONS[name] = parser
        return parser

    return register


def _unknown_keys(table: Mapping[str, Any], known: Iterable[str], where: Where) -> None:
    known = list(known)
    for key in table:
        if key not in known:
            raise where.dot(key).error("unknown key", _suggest(key, known))


def _type_name(value: object) -> str:
    return {
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        str: "a string",
        list: "an array",
        dict: "a table",
    }.get(type(value), type(value).__name__)


def _string(value: Any, where: Where, remedy: str) -> str:
    if not isinstance(value, str) or not value.strip():
        shown = repr(value) if isinstance(value, str) else _type_name(value)
        raise where.error(f"expected a non-empty string, got {shown}", remedy)
    return value.strip()


def _strings(value: Any, where: Where, remedy: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not value:
        shown = "an empty array" if value == [] else _type_name(value)
        raise where.error(f"expected a non-empty array of strings, got {shown}", remedy)
    items: list[str] = []
    for index, item in enumerate(value):
        text = _string(item, where.at(index), remedy)
        if text in items:
            raise where.at(index).error(f"{text!r} is listed twice", "list each name once")
        items.append(text)
    return tuple(items)


def _url(value: Any, where: Where) -> str:
    remedy = 'write it like url = "http://127.0.0.1:8000"'
    url = _string(value, where, remedy).rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise where.error(f"{url!r} is not an http(s) URL", remedy)
    return url


_BACKEND_KEYS = ("url", "models", "name")


@section("backends")
def _backends_section(value: Any, where: Where) -> Mapping[str, Any]:
    """``[[backends]]`` tables (url, models, name), or simply URLs: a comma-separated string
    or an array of strings."""
    if isinstance(value, str):
        value = [part for part in value.split(",") if part.strip()]
    if not isinstance(value, list):
        raise where.error(
            f"expected [[backends]] tables, got {_type_name(value)}",
            'write one [[backends]] table per backend, with url = "http://host:port"',
        )
    specs: list[BackendSpec] = []
    for index, item in enumerate(value):
        here = where.at(index)
        if isinstance(item, str):
            spec = BackendSpec(_url(item, here))
        elif isinstance(item, dict):
            _unknown_keys(item, _BACKEND_KEYS, here)
            if "url" not in item:
                raise here.dot("url").error(
                    "missing", 'every [[backends]] table needs url = "http://host:port"'
                )
            models = item.get("models")
            name = item.get("name")
            spec = BackendSpec(
                url=_url(item["url"], here.dot("url")),
                models=None
                if models is None
                else _strings(
                    models,
                    here.dot("models"),
                    "list the served model names, or leave models out to read them from the "
                    "backend's /v1/models",
                ),
                name=None
                if name is None
                else _string(name, here.dot("name"), 'write name = "gpu0", or leave it out'),
            )
        else:
            raise here.error(
                f"expected a table, got {_type_name(item)}",
                'write [[backends]] with url = "http://host:port"',
            )
        for other, earlier in enumerate(specs):
            if earlier.url == spec.url:
                raise here.dot("url").error(
                    f"{spec.url!r} is already backends[{other}]", "list each backend once"
                )
            if spec.name is not None and earlier.name == spec.name:
                raise here.dot("name").error(
                    f"{spec.name!r} is already the name of backends[{other}]",
                    "give each backend its own name",
                )
        specs.append(spec)
    return {"backend_specs": tuple(specs)}


@section("aliases")
def _aliases_section(value: Any, where: Where) -> Mapping[str, Any]:
    """``[aliases]``: public model name -> served model names (first the target, then the
    fallbacks), or one served name as a string. A name with ``*``, ``?`` or ``[...]`` is a
    pattern that any name nothing serves may match (``"claude-*" = "qwen3-coder"``)."""
    if not isinstance(value, dict):
        raise where.error(
            f"expected a table, got {_type_name(value)}",
            'write [aliases] with lines like coder = ["qwen-32b"]',
        )
    aliases: dict[str, tuple[str, ...]] = {}
    for name, targets in value.items():
        remedy = (
            f'write {name} = ["served-model-name", ...]: the first is the target, the rest '
            f'fallbacks; or {name} = "served-model-name"'
        )
        if isinstance(targets, str):
            aliases[name] = (_string(targets, where.dot(name), remedy),)
        else:
            aliases[name] = _strings(targets, where.dot(name), remedy)
    return {"aliases": FrozenMap(aliases)}


# [limits]: the parser sits beside the values it builds (limits.py, docs/LIMITS.md).
section("limits")(parse_limits)
# [clients]: the same, beside its values (clients.py).
section("clients")(parse_clients)


def _check_aliases(settings: Settings, where: Where) -> None:
    """Alias targets must be served, when every backend lists its models (otherwise the models
    are only known once the backends answer /v1/models)."""
    specs = settings.backend_specs
    if not specs or any(b.models is None for b in specs):
        return
    served = [m for b in specs for m in b.models or ()]
    for name, targets in settings.aliases.items():
        for index, target in enumerate(targets):
            if target not in served:
                raise (
                    where.dot(name)
                    .at(index)
                    .error(
                        f"{target!r} is served by no backend (served: {', '.join(served)})",
                        "add it to a [[backends]] models list or correct the name",
                    )
                )


def _check_default_model(settings: Settings, where: Where) -> None:
    """``default_model`` must be served, when every backend lists its models."""
    specs = settings.backend_specs
    default = settings.default_model
    if not default or default == NO_DEFAULT_MODEL or not specs:
        return
    if any(b.models is None for b in specs):
        return
    served = [m for b in specs for m in b.models or ()]
    if default not in served:
        raise where.error(
            f"{default!r} is served by no backend (served: {', '.join(served)})",
            "name a served model, or add it to a [[backends]] models list",
        )


@dataclass(frozen=True)
class ConfigFile:
    """A parsed config file: top-level settings by name, and section values by field."""

    path: str
    settings: Mapping[str, Any]
    fields: Mapping[str, Any]


def read_config_file(path: str) -> ConfigFile:
    """Read and check a ``--config`` TOML file; every problem is a ConfigError naming the key."""
    target = Path(path)
    if target.is_dir():
        raise ConfigError(f"--config {path!r} is a directory; pass the path of a TOML file.")
    try:
        with target.open("rb") as file:
            data = tomllib.load(file)
    except FileNotFoundError:
        raise ConfigError(
            f"--config {path!r}: no such file; pass the path of a TOML file "
            "(docs/CONFIG.md has an example)."
        ) from None
    except OSError as exc:
        raise ConfigError(f"--config {path!r} cannot be read: {exc.strerror}.") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(
            f"{path}: invalid TOML: {exc}; fix that line (docs/CONFIG.md shows the format)."
        ) from None
    settings: dict[str, Any] = {}
    fields: dict[str, Any] = {}
    for key, value in data.items():
        here = Where(path, key)
        if key == "config":
            raise here.error("a config file cannot name another", "remove this key")
        if key in SECTIONS:
            fields.update(SECTIONS[key](value, here))
        elif key in SETTINGS_BY_NAME:
            settings[key] = _from_toml(SETTINGS_BY_NAME[key], value, here)
        else:
            known = [*(n for n in SETTINGS_BY_NAME if n != "config"), *SECTIONS]
            raise here.error("unknown key", _suggest(key, known))
    return ConfigFile(path, settings, fields)


def _from_toml(item: Setting, value: Any, where: Where) -> Any:
    """A TOML value checked against the setting's type (TOML is typed; flags arrive typed)."""
    default = item.default
    if isinstance(default, Mapping):
        if not isinstance(value, dict):
            raise where.error(
                f"expected a table, got {_type_name(value)}",
                "write [sim] with lines like max_model_len = 262144",
            )
        return sim_overrides(value, str(where.file) + ": sim")
    if isinstance(default, bool):
        ok = isinstance(value, bool)
        expected = "true or false"
    elif isinstance(default, int):
        ok = isinstance(value, int) and not isinstance(value, bool)
        expected = "an integer"
    elif isinstance(default, float):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        expected = "a number"
        value = float(value) if ok else value
    else:
        ok = isinstance(value, str)
        expected = "a string"
    if not ok:
        raise where.error(
            f"expected {expected}, got {_type_name(value)} {value!r}",
            f"see `{item.flag}` in `thunderproxy serve --help`",
        )
    return value
