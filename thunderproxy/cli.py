"""The ``thunderproxy`` command line: a thin click layer over the Python API."""

from __future__ import annotations

import json
import logging
import sqlite3
import sys
from datetime import UTC, datetime
from functools import partial
from typing import Any

import click
import trio

from . import __version__
from .config import (
    SETTINGS_BY_NAME,
    Settings,
    SettingsCommand,
    given_values,
    load_settings,
    settings_options,
)
from .errors import ThunderproxyError, our_error

#: serve's --db setting, for the commands that open the same audit db.
DB = SETTINGS_BY_NAME["db"]


class JsonFormatter(logging.Formatter):
    """One JSON object per line (``--log-format json``): what a log collector parses without
    a pattern. A traceback is one string member, so a record stays one line."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            line["exception"] = record.exc_text
        return json.dumps(line, ensure_ascii=False)


def configure_logging(level: str, log_format: str = "text") -> None:
    handler = logging.StreamHandler(sys.stderr)
    if log_format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=getattr(logging, level.upper()), handlers=[handler])
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
      thunderproxy explore thunderproxy.db     # Datasette on a copied audit db
    """


@cli.command(cls=SettingsCommand)
@settings_options()
@click.pass_context
def serve(ctx: click.Context, /, **values: Any) -> None:
    """Run the proxy until SIGINT/SIGTERM/SIGHUP (in-flight requests are drained first).

    With no --backends it starts a simulated vLLM of its own (no GPU needed). Agents need only
    its address: http://HOST:PORT/v1 for OpenAI clients, http://HOST:PORT for Anthropic's
    (Claude Code: ANTHROPIC_BASE_URL).

    Every option can also be set through the environment variable THUNDERPROXY_<NAME> (e.g.
    THUNDERPROXY_READ_TIMEOUT for --read-timeout), or as a key of the --config file
    (docs/CONFIG.md); flags beat variables, which beat the file.
    """
    given, origins = given_values(ctx, values)
    try:
        settings: Settings = load_settings(given, origins=origins)
    except ThunderproxyError as exc:
        # One line: what is wrong and how to fix it (a usage dump would bury it).
        raise click.ClickException(exc.message) from None
    configure_logging(settings.log_level, settings.log_format)
    if settings.workers > 1:
        from .scaleout import supervise

        try:
            code = supervise(settings)
        except ThunderproxyError as exc:
            raise click.ClickException(exc.message) from None
        sys.exit(code)
    from .runtime import run

    try:
        trio.run(partial(run, settings, handle_signals=True))
    except BaseException as exc:
        error = our_error(exc)
        if error is None:
            raise
        raise click.ClickException(error.message) from None


@cli.command()
@settings_options([DB])
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


@cli.command()
@click.argument("db", default=DB.default, envvar=DB.envvar)
@click.option("--host", default="127.0.0.1", show_default=True, help="Interface to listen on.")
@click.option(
    "--port", default=8301, show_default=True, type=int, help="TCP port (0: any free port)."
)
def explore(db: str, host: str, port: int) -> None:
    """Browse an audit db with Datasette, read-only, at /datasette/.

    The same tables, views, canned queries and dashboard that `serve` mounts on the proxy's
    port, for a db copied off a server (copy its -wal file too if the proxy is still running). DB
    defaults to $THUNDERPROXY_DB, else thunderproxy.db.

    \b
    Examples:
      thunderproxy explore                          # ./thunderproxy.db on port 8301
      thunderproxy explore copied.db --port 8400
    """
    from .explore.standalone import serve_standalone

    def ready(url: str) -> None:
        click.echo(f"exploring {db} read-only at {url} (Ctrl-C stops)", err=True)

    try:
        serve_standalone(db, host=host, port=port, ready=ready)
    except ThunderproxyError as exc:
        raise click.ClickException(exc.message) from None
    except OSError as exc:
        raise click.ClickException(f"Cannot listen on {host}:{port}: {exc.strerror}.") from None


@cli.command("client-key")
@click.argument("name")
@click.option(
    "--stdin",
    "from_stdin",
    is_flag=True,
    help="Hash the key read from standard input (one line) instead of making a new one.",
)
def client_key(name: str, from_stdin: bool) -> None:
    """Make a key for a client of a shared proxy ([clients], docs/CONFIG.md).

    Prints the key, to give to the client NAME (the proxy never stores it), and the line for
    the config file's [clients.keys] table, which holds only the key's SHA-256.

    \b
    Examples:
      thunderproxy client-key alice
      printf %s "$KEY" | thunderproxy client-key alice --stdin
    """
    from .config.clients import key_digest, name_problem, new_key

    problem = name_problem(name)
    if problem is not None:
        raise click.ClickException(problem + ".")
    key = sys.stdin.readline().rstrip("\r\n") if from_stdin else new_key()
    if not key:
        raise click.ClickException("No key on standard input; pipe one line, or leave --stdin out.")
    if not from_stdin:
        click.echo(f"key for {name} (give it to them; it is shown only now): {key}")
    click.echo(f'[clients.keys] line: {name} = "{key_digest(key)}"')


def _register_optional_commands() -> None:
    try:
        from .sim.cli import sim_command
    except ImportError:  # the simulator is part of the package; this guards partial checkouts
        return
    cli.add_command(sim_command)
    from .bench.cli import bench_command, demo_command

    cli.add_command(bench_command)
    cli.add_command(demo_command)


_register_optional_commands()


def main() -> None:
    cli(prog_name="thunderproxy")
