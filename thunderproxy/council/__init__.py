"""Council jobs (docs/COUNCIL.md): several models answer, rank each other's anonymized answers
and a chairman synthesises, every member's calls a scheduled program, every event durable in
SQLite.

Layers: ``deliberation.py`` (pure: prompts, labels, ranking parsing, aggregation, histories),
``tools.py`` (fetch_url, web_search, the tool loop), ``llm.py`` (the ``ChatClient`` protocol,
the request and stream it speaks), ``gateway_client.py`` (``GatewayChatClient``: the protocol
over the proxy's own gateway, in process), ``pipeline.py`` (the three stages), ``store.py``
(SQLite), ``runner.py`` (jobs in the runtime nursery, replay, resume), ``routes.py`` (HTTP, the
page in ``static/``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import httpx
import trio
from quart import Blueprint

from ..backends.http import tls_context
from ..config import Settings
from ..errors import ConfigError
from .deliberation import MAX_MEMBERS
from .llm import ChatClient, ChatEvent, Finished, TextDelta, ToolCall
from .pipeline import CouncilConfig
from .routes import create_blueprint
from .runner import CouncilRunner
from .store import JobStore
from .tools import Toolbox, ToolSettings

__all__ = [
    "ChatClient",
    "ChatEvent",
    "Council",
    "CouncilConfig",
    "CouncilRunner",
    "Finished",
    "JobStore",
    "TextDelta",
    "ToolCall",
    "council_config",
    "open_council",
    "serve_council",
]


def council_config(settings: Settings) -> CouncilConfig:
    """The council named by ``--council-models`` and friends, validated."""
    members = tuple(m.strip() for m in settings.council.models.split(",") if m.strip())
    if len(set(members)) != len(members):
        raise ConfigError(f"--council-models names a model twice: {settings.council.models!r}.")
    if len(members) > MAX_MEMBERS:
        raise ConfigError(f"--council-models: at most {MAX_MEMBERS} members, got {len(members)}.")
    chairman = settings.council.chairman.strip() or (members[0] if members else "")
    return CouncilConfig(
        members=members,
        chairman=chairman,
        title_model=settings.council.title_model.strip() or chairman,
        member_timeout_s=settings.council.member_timeout,
        tool_rounds=settings.council.tool_rounds,
        max_tokens=settings.council.max_tokens or None,
    )


@dataclass
class Council:
    """What the runtime holds: the store, the runner and the blueprint to mount."""

    store: JobStore
    runner: CouncilRunner
    blueprint: Blueprint

    async def aclose(self) -> None:
        """Close the store once the runner has stopped; the runtime calls it after the HTTP
        server has drained (the routes read the store until then) and the runner is
        cancelled."""
        with trio.CancelScope(shield=True):
            await self.runner.wait_idle()
        await self.store.aclose()


async def open_council(
    settings: Settings, *, db_generation: Callable[[], int] | None = None
) -> Council:
    """Open the council's store on the audit db and build its runner and routes.
    ``db_generation``: the audit writer's count of db files recreated under it; the store
    reconnects when it changes (``JobStore``)."""
    config = council_config(settings)
    store = await JobStore.open(settings.db, db_generation=db_generation)
    runner = CouncilRunner(
        store,
        config,
        max_jobs=settings.council.max_jobs,
        max_jobs_per_client=settings.council.max_jobs_per_client,
    )
    blueprint = create_blueprint(
        runner, admin_token=settings.admin_token, keepalive_s=settings.council.keepalive
    )
    return Council(store, runner, blueprint)


async def serve_council(
    council: Council,
    settings: Settings,
    *,
    client: ChatClient,
    shutdown: trio.Event,
    task_status: trio.TaskStatus[CouncilRunner] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run council jobs until ``shutdown``. Members are called through ``client``: the runtime
    passes a ``GatewayChatClient``, the proxy's own gateway in process, so every call is a
    scheduled program like any client's.

    Supervised by the runtime (``supervision.py``): a failure restarts it, so the store stays
    open across it and is closed by ``Council.aclose``."""
    tool_settings = ToolSettings(
        timeout_s=min(20.0, settings.council.member_timeout or 20.0),
        allow_private=settings.council.tools_allow_private,
        search_url=settings.council.search_url,
        search_key=settings.council.search_key,
    )
    async with httpx.AsyncClient(
        timeout=httpx.Timeout(tool_settings.timeout_s),
        verify=tls_context(),
        headers={"user-agent": "thunderproxy-council"},
    ) as fetches:
        if settings.council.tools:
            council.runner.toolbox = Toolbox(fetches, tool_settings)
        await council.runner.serve(client, shutdown=shutdown, task_status=task_status)
    # The tools' client is closed, but the routes may still read the store until the HTTP
    # server has drained; the runtime cancels this task then.
    await trio.sleep_forever()
