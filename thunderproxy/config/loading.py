"""From defaults, a config file, the environment and flags to one :class:`Settings`
(precedence: defaults < config file < environment variables < flags), and the embedded
simulator's settings (``--sim``, ``THUNDERPROXY_SIM_*``).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Mapping
from typing import Any

import click

from ..errors import ConfigError
from ..where import Where
from .embedded import SIM_ENV_PREFIX, sim_environment, sim_overrides
from .limits import check_served
from .sections import _check_aliases, _check_default_model, read_config_file
from .settings import (
    SETTINGS,
    SETTINGS_BY_NAME,
    STRUCTURED,
    BackendSpec,
    FrozenMap,
    Setting,
    Settings,
    _suggest,
)

# --- loading --------------------------------------------------------------------------------


def _parse_backends(value: str | Iterable[str], origin: str) -> tuple[str, ...]:
    items = value.split(",") if isinstance(value, str) else list(value)
    urls = []
    for raw in items:
        url = raw.strip().rstrip("/")
        if not url:
            continue
        if not url.startswith(("http://", "https://")):
            raise ConfigError(
                f"{origin}: backend {raw!r} is not an http(s) URL; pass e.g. "
                "--backends http://127.0.0.1:8000"
            )
        urls.append(url)
    return tuple(urls)


def _check(item: Setting, value: Any, origin: str) -> None:
    numeric = isinstance(item.default, (int, float)) and not isinstance(item.default, bool)
    problem = item.check(value) if item.check else None
    if problem is None and item.choices and value not in item.choices:
        problem = f"is not one of: {', '.join(item.choices)}"
    if problem is None and numeric and value < 0:
        problem = "must be >= 0"
    if problem:
        raise ConfigError(f"{origin}: {value!r} {problem}.")


def load_settings(
    values: Mapping[str, Any] | None = None,
    *,
    origins: Mapping[str, str] | None = None,
    **overrides: Any,
) -> Settings:
    """Validate raw values (from flags, env or code, by setting name) into :class:`Settings`.

    ``None`` means "not given". When ``config`` names a TOML file, its values sit under the
    given ones (defaults < file < given). ``origins`` names where a given value came from
    (e.g. an environment variable) for error messages; the default is its flag.
    """
    raw: dict[str, Any] = {
        k: v for k, v in {**(values or {}), **overrides}.items() if v is not None
    }
    known = [*SETTINGS_BY_NAME, *STRUCTURED]
    for name in raw:
        if name not in known:
            raise ConfigError(
                f"Unknown setting {name!r} (`thunderproxy serve --help` lists them); "
                + _suggest(name, known)
            )
    given_origin = {**{s.name: s.flag for s in SETTINGS}, **(origins or {})}
    file = read_config_file(raw["config"]) if raw.get("config") else None
    merged: dict[str, tuple[Any, str]] = {}
    file_sim = None if file is None else file.settings.get("sim")
    if file is not None:
        for name, value in file.settings.items():
            merged[name] = (value, f"{file.path}: {name}")
    for name, value in raw.items():
        if name == "sim":
            # One simulator setting at a time: the file's table, then variables, then flags.
            value = sim_overrides(value, given_origin[name])
            if name in merged:
                value = FrozenMap({**merged[name][0], **value})
        if name in SETTINGS_BY_NAME:
            merged[name] = (value, given_origin[name])
    fields: dict[str, Any] = dict(file.fields) if file is not None else {}
    fields.update({k: v for k, v in raw.items() if k in STRUCTURED})
    groups: dict[tuple[str, ...], dict[str, Any]] = {}
    for name, (value, origin) in merged.items():
        item = SETTINGS_BY_NAME[name]
        if name == "backends":
            value = _parse_backends(value, origin)
            if "backends" in raw:
                # A --backends flag or env var replaces the file's backends, models and all.
                fields["backend_specs"] = tuple(BackendSpec(url) for url in value)
        _check(item, value, origin)
        groups.setdefault(item.path[:-1], {})[item.path[-1]] = value
    if "backend_specs" in fields:
        groups.setdefault((), {}).pop("backends", None)
    kwargs = groups.get((), {})
    for path, group_values in groups.items():
        if path:
            # Only one level of nesting today: Settings.policy.
            (name,) = path
            kwargs[name] = dataclasses.replace(getattr(Settings(), name), **group_values)
    settings = Settings(**kwargs, **fields)
    if settings.sim and settings.backends:
        if given_origin.get("sim") == SIM_ENV_PREFIX + "*" and file_sim is None:
            # Variables left in the shell for a `thunderproxy sim` that --backends points at.
            settings = dataclasses.replace(settings, sim=FrozenMap())
        else:
            raise ConfigError(
                "--sim (or a [sim] table) sets the simulator that serve starts when no "
                "--backends are given; remove it, or the backends."
            )
    if file is not None:
        _check_aliases(settings, Where(file.path, "aliases"))
        _check_default_model(settings, Where(file.path, "default_model"))
        specs = settings.backend_specs
        if settings.limits is not None and specs and all(b.models is not None for b in specs):
            served = {m for b in specs for m in b.models or ()}
            check_served(settings.limits, served, Where(file.path, "limits"))
    if settings.protect_reads and not settings.admin_token:
        raise ConfigError("--protect-reads needs --admin-token: set the token readers must send.")
    if settings.workers > 1 and not settings.redis:
        raise ConfigError(
            f"--workers {settings.workers} needs --redis: processes behind one port see each "
            "other's programs and limits only through Redis; pass --redis "
            "redis://host:6379/0, or --workers 1."
        )
    if settings.workers > 1 and not settings.backends:
        raise ConfigError(
            f"--workers {settings.workers} needs --backends: each process would start an "
            "embedded simulator of its own; pass --backends URL, or --workers 1."
        )
    return settings


def given_values(
    ctx: click.Context, values: Mapping[str, Any]
) -> tuple[dict[str, Any], dict[str, str]]:
    """The values a user set (in the environment or as flags), leaving out click's defaults so
    a config file can supply them; and where each came from, for error messages."""
    given: dict[str, Any] = {}
    origins: dict[str, str] = {}
    for name, value in values.items():
        source = ctx.get_parameter_source(name)
        if source in (click.core.ParameterSource.DEFAULT, click.core.ParameterSource.DEFAULT_MAP):
            continue
        given[name] = value
        if source is click.core.ParameterSource.ENVIRONMENT:
            origins[name] = SETTINGS_BY_NAME[name].envvar
    if "sim" in values:
        # The simulator's variables are `thunderproxy sim`'s own, one per setting; flags win.
        from_env = sim_environment(os.environ)
        if from_env and "sim" not in given:
            origins["sim"] = SIM_ENV_PREFIX + "*"
        if from_env:
            given["sim"] = (*from_env, *given.get("sim", ()))
    return given, origins
