"""The settings as click options and as help: one option per setting (each also read from its
environment variable), ``serve --help`` grouped by ``HELP_SECTIONS``, and the README's table.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import click

from .settings import SETTINGS, F, Setting


def settings_options(settings: Iterable[Setting] = SETTINGS) -> Callable[[F], F]:
    """Decorate a click command with one option per setting, each also read from its env var."""

    def decorate(fn: F) -> F:
        for item in reversed(tuple(settings)):
            default = item.default
            kwargs: dict[str, Any] = {
                "help": item.help,
                # Each reads THUNDERPROXY_<NAME>; the command's help says so once.
                "envvar": item.envvar,
                # An empty default says nothing worth a line.
                "show_default": not item.secret and item.default not in ("", ()),
            }
            if isinstance(default, Mapping):
                # NAME=VALUE pairs, repeatable; their variables are THUNDERPROXY_SIM_<NAME>.
                kwargs.update(multiple=True, metavar="NAME=VALUE", envvar=None, show_default=False)
                decls = [item.flag, item.name]
                default = ()
            elif isinstance(default, bool):
                decls = [f"{item.flag}/--no-{item.flag[2:]}", item.name]
            else:
                decls = [item.flag, item.name]
                if item.choices:
                    kwargs["type"] = click.Choice(item.choices)
                elif isinstance(default, float):
                    kwargs["type"] = float
                elif isinstance(default, int):
                    kwargs["type"] = int
                elif isinstance(default, tuple):
                    # A list on the command line is one comma-separated value.
                    default = ",".join(default)
            kwargs["default"] = default
            fn = click.option(*decls, **kwargs)(fn)
        return fn

    return decorate


#: How ``serve --help`` groups the settings: the common ones first, then one section per area.
#: A setting no section names is listed under "Other options" (and test_config says so).
HELP_SECTIONS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "Common options",
        ("backends", "default_model", "port", "host", "db", "config", "router", "sim",
         "log_level"),
    ),
    (
        "Backends",
        ("metrics", "metrics_interval", "connect_timeout", "first_byte_timeout", "read_timeout",
         "max_connections", "ready_timeout"),
    ),
    (
        "Programs and scheduling (docs/SCHEDULING.md)",
        ("recognition", "profile", "restore", "monitor_interval", "decode_buffer",
         "pause_cooldown", "resume_cooldown", "tool_coefficient", "acting_half_life",
         "admission_half_life", "max_wait", "max_wait_share", "interactive_max_wait",
         "default_program_class", "mid_program_head_start", "hold",
         "make_room_at_once", "idle_claims", "return_evidence", "resume_protection",
         "idle_lease", "target_fill", "max_queue_wait", "gate_returns", "tier_max_load_share",
         "tier_reload_window"),
    ),
    (
        "Serving, access and the audit log",
        ("admin_token", "passthrough", "protect_reads", "datasette", "http_front", "certfile",
         "keyfile", "max_body_bytes", "max_header_bytes", "client_timeout", "shutdown_grace",
         "audit_queue", "log_format"),
    ),
    ("Several processes or instances (docs/DEPLOY.md)", ("workers", "redis", "redis_heartbeat")),
    (
        "LLM council (docs/COUNCIL.md)",
        ("council_models", "council_chairman", "council_title_model", "council_member_timeout",
         "council_max_tokens", "council_tools", "council_tool_rounds",
         "council_tools_allow_private", "council_search_url", "council_search_key",
         "council_keepalive", "council_max_jobs", "council_max_jobs_per_client"),
    ),
    (
        "Serverless worker mode (docs/WORKER.md)",
        ("report_addr", "unsecured", "max_wait_time", "parallel", "benchmark", "benchmark_cache",
         "worker_ready_timeout", "program_tokens"),
    ),
)  # fmt: skip


class SettingsCommand(click.Command):
    """A command whose ``--help`` lists its options in the sections of ``HELP_SECTIONS``."""

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        records: dict[str, tuple[str, str]] = {}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is not None and param.name is not None:
                records[param.name] = record
        for title, names in HELP_SECTIONS:
            rows = [records.pop(name) for name in names if name in records]
            if rows:
                with formatter.section(title):
                    formatter.write_dl(rows)
        if records:
            with formatter.section("Other options"):
                formatter.write_dl(list(records.values()))


def settings_table() -> str:
    """The README's ``serve`` flags table, generated from the settings table."""

    def shown(item: Setting) -> str:
        value = item.default
        if isinstance(value, bool):
            return "on" if value else "off"
        if value in ("", ()) or (isinstance(value, Mapping) and not value):
            return "(empty)"
        return f"`{value}`"

    rows = ["| flag | default | meaning |", "| --- | --- | --- |"]
    for item in SETTINGS:
        flag = item.flag
        if isinstance(item.default, bool):
            flag = f"{item.flag}/--no-{item.flag[2:]}"
        elif isinstance(item.default, Mapping):
            flag = f"{item.flag} NAME=VALUE"
        rows.append(f"| `{flag}` | {shown(item)} | {item.help} |")
    return "\n".join(rows) + "\n"
