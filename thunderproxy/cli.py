"""The ``thunderproxy`` command line: a thin click layer over the Python API."""

from __future__ import annotations

import logging
import sqlite3
import sys
from functools import partial
from typing import Any

import click
import trio

from . import __version__
from .config import Settings, load_settings, settings_options
from .errors import ThunderproxyError

DB_OPTION = click.option(
    "--db",
    default="thunderproxy.db",
    show_default=True,
    envvar="THUNDERPROXY_DB",
    show_envvar=True,
    help="SQLite audit db.",
)


def configure_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    # One line per backend request would drown the proxy's own messages.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLevelName(level.upper())))


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="thunderproxy")
def cli() -> None:
    """thunderproxy: a program-aware proxy for agentic LLM inference.

    It sits between agents and OpenAI-compatible backends (vLLM, SGLang), tracks each agent
    task by program_id, and logs every program transition and step to SQLite.

    \b
    Examples:
      thunderproxy serve --backends http://127.0.0.1:8000
      thunderproxy serve                      # embedded simulated vLLM, no GPU needed
      thunderproxy migrate --list
    """


@cli.command()
@settings_options()
def serve(**values: Any) -> None:
    """Run the proxy until SIGINT/SIGTERM (in-flight requests are drained first).

    Every option can also be set through the environment variable shown next to it.
    """
    try:
        settings: Settings = load_settings(values)
    except ThunderproxyError as exc:
        raise click.UsageError(exc.message) from None
    configure_logging(settings.log_level)
    from .runtime import run

    try:
        trio.run(partial(run, settings, handle_signals=True))
    except ThunderproxyError as exc:
        raise click.ClickException(exc.message) from None


@cli.command()
@DB_OPTION
@click.option("--list", "list_only", is_flag=True, help="Only list migrations and their state.")
def migrate(db: str, list_only: bool) -> None:
    """Apply the audit db's pending schema migrations (serve does this at startup too)."""
    from .audit import migrations
    from .audit.writer import open_database

    if list_only:
        conn = sqlite3.connect(db)
        try:
            done = migrations.applied(conn)
        finally:
            conn.close()
        for migration in migrations.available():
            state = "applied" if migration.name in done else "pending"
            click.echo(f"{migration.name}  {state}")
        return
    try:
        conn = open_database(db)
    except ThunderproxyError as exc:
        raise click.ClickException(exc.message) from None
    conn.close()
    click.echo(f"{db}: schema is current ({len(migrations.available())} migrations).")


def _register_optional_commands() -> None:
    try:
        from .sim.cli import sim_command
    except ImportError:  # the simulator is part of the package; this guards partial checkouts
        return
    cli.add_command(sim_command)


_register_optional_commands()


def main() -> None:
    cli(prog_name="thunderproxy")
