"""``CouncilRunner``: runs council jobs in the runtime's nursery, makes every event durable
before anyone sees it, lets any number of followers replay and follow a job, and on startup
resumes the jobs a previous run left unfinished, from their last completed stage.

A job outlives the HTTP request that started it: the client may leave and come back with
``after=N``. Shutdown cancels running jobs where they stand; their rows still say which
stage they were in, so the next start picks them up.

A job fails alone: whatever ends it, nothing escapes to the runner's nursery. A job whose events
cannot be written (``StoreUnavailable``, after the store's retries) ends with an ``error`` event
kept in memory only (its live followers see it, and for the last ``UNRECORDED_KEPT`` such jobs
a follower that comes later); its row keeps the last stage it recorded, so the next start
resumes it.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

import trio

from ..errors import InvalidRequest
from . import deliberation, pipeline
from .errors import JobFailed, JobRunning, StoreUnavailable, TooManyJobs
from .llm import ChatClient, ForClient
from .pipeline import CouncilConfig
from .records import (
    Complete,
    Failed,
    Job,
    JobEvent,
    Resumed,
    Stage1Complete,
    Stage2Complete,
    Stage3Complete,
    TitleComplete,
    answers_json,
    rankings_json,
    standings_json,
)
from .store import Event, JobStore
from .tools import Toolbox

log = logging.getLogger("thunderproxy.council")

#: Jobs that ended unrecorded whose last event is kept in memory for followers that come late.
UNRECORDED_KEPT = 256


def leaves(exc: BaseException) -> list[BaseException]:
    """The exceptions an exception group holds, nested groups opened; ``[exc]`` for any
    other exception."""
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for inner in exc.exceptions for leaf in leaves(inner)]
    return [exc]


@dataclass
class LiveJob:
    """A job running in this process: its events so far (seq i at index i-1) and a wake-up
    for followers."""

    job_id: str
    conversation_id: str
    events: list[Event] = field(default_factory=list)
    changed: trio.Event = field(default_factory=trio.Event)
    finished: bool = False
    done: trio.Event = field(default_factory=trio.Event)
    #: Why the job ended unrecorded: its last events could not be written (None: recorded).
    unrecorded: str | None = None

    def notify(self) -> None:
        self.changed.set()
        self.changed = trio.Event()


class CouncilRunner:
    """Owns the council's jobs. Routes call :meth:`start`, :meth:`follow`, :meth:`wait`."""

    def __init__(
        self,
        store: JobStore,
        config: CouncilConfig,
        *,
        toolbox: Toolbox | None = None,
        max_jobs: int = 16,
        max_jobs_per_client: int = 4,
    ) -> None:
        self.store = store
        self.config = config
        self.toolbox = toolbox
        self.max_jobs = max_jobs
        self.max_jobs_per_client = max_jobs_per_client
        #: The client address that started each running job (None: resumed after a restart).
        self._client_of: dict[str, str | None] = {}
        self.client: ChatClient | None = None
        self.live: dict[str, LiveJob] = {}
        self._by_conversation: dict[str, str] = {}
        self._nursery: trio.Nursery | None = None
        self.stopped = False
        #: The last (unrecorded) event of the latest jobs that could not record their end.
        self._unrecorded: OrderedDict[str, Event] = OrderedDict()
        #: Set while no ``serve`` runs (so every job has ended and no write is in flight).
        self._idle = trio.Event()
        self._idle.set()

    # --- lifecycle -------------------------------------------------------------------------------
    async def serve(
        self,
        client: ChatClient,
        *,
        shutdown: trio.Event | None = None,
        task_status: trio.TaskStatus[CouncilRunner] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Run jobs until cancelled or ``shutdown`` is set; resumes unfinished jobs first."""
        self.client = client
        self.stopped = False
        self._idle = trio.Event()
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                for job_id in await self.store.unfinished_jobs():
                    job = await self.store.get_job(job_id)
                    if job is not None:
                        log.info("resuming council job %s after stage %d", job_id,
                                 job.completed_stage)  # fmt: skip
                        await self._launch(job)
                task_status.started(self)
                if shutdown is not None:
                    await shutdown.wait()
                    # Running jobs stop where they are; the next start resumes them.
                    nursery.cancel_scope.cancel()
                else:
                    await trio.sleep_forever()
        finally:
            self.stopped = True
            self._nursery = None
            self._idle.set()
            for live in list(self.live.values()):
                live.notify()

    @property
    def ready(self) -> bool:
        return self._nursery is not None

    async def wait_idle(self) -> None:
        """Until no ``serve`` runs: every job has ended, none is writing."""
        await self._idle.wait()

    # --- starting and following ------------------------------------------------------------------
    def running_job(self, conversation_id: str) -> str | None:
        return self._by_conversation.get(conversation_id)

    def _check_capacity(self, client: str | None) -> None:
        """Refuse a new job past the caps: a job outlives the request that started it, so a
        client that starts many and leaves would otherwise have every one run to the end.
        Jobs being started count (their reservation holds ``"starting"``)."""
        running = len(self._by_conversation)
        if running >= self.max_jobs:
            raise TooManyJobs(
                f"{running} council jobs are running, the most --council-max-jobs allows; "
                "wait for one to finish and ask again."
            )
        if client is None:
            return
        mine = sum(1 for owner in self._client_of.values() if owner == client)
        if mine >= self.max_jobs_per_client:
            raise TooManyJobs(
                f"Client {client} has {mine} council jobs running, the most "
                "--council-max-jobs-per-client allows; wait for one to finish (follow it at "
                ".../job/stream) and ask again."
            )

    async def start(
        self,
        conversation_id: str,
        question: str,
        client: str | None = None,
        *,
        owner: str | None = None,
    ) -> str:
        """Record the question and start its job; raises ``JobRunning`` if one runs already,
        ``TooManyJobs`` past the caps on running jobs (``client``: who the caps count, the
        caller's name with ``[clients]``, else its address). ``owner``: the configured client
        that asked (``[clients]``), whose calls the job's are: its steps record it."""
        if self._nursery is None:
            raise JobFailed("The council is not running; the proxy is starting or stopping.")
        if not self.config.members:
            raise InvalidRequest(
                "No council is configured: start the proxy with --council-models a,b,c "
                "(model names its backends serve)."
            )
        running = self._by_conversation.get(conversation_id)
        if running is not None:
            raise JobRunning(conversation_id, running)
        self._check_capacity(client)
        # Reserve before the first await, so two concurrent starts cannot both pass the check.
        self._by_conversation[conversation_id] = "starting"
        reservation = f"starting:{conversation_id}"
        self._client_of[reservation] = client
        job_id: str | None = None
        try:
            job_id = await self.store.create_job(
                conversation_id,
                question,
                members=self.config.members,
                chairman=self.config.chairman,
                title_model=self.config.title_model,
                client=owner,
            )
            job = await self.store.get_job(job_id)
            assert job is not None
            # The reservation becomes the job's own entry with no await between.
            self._client_of[job_id] = self._client_of.pop(reservation)
            await self._launch(job)
        except BaseException:
            self._by_conversation.pop(conversation_id, None)
            self._client_of.pop(reservation, None)
            if job_id is not None:
                self._client_of.pop(job_id, None)
            raise
        return job_id

    async def _launch(self, job: Job) -> None:
        assert self._nursery is not None
        live = LiveJob(job.id, job.conversation_id)
        if job.last_seq:
            live.events = await self.store.events(job.id)
        self.live[live.job_id] = live
        self._by_conversation[live.conversation_id] = live.job_id
        self._nursery.start_soon(self._run, job, live)

    async def follow(
        self, job_id: str, after: int = 0, *, keepalive_s: float = 15.0
    ) -> AsyncGenerator[Event | None, None]:
        """The job's events after ``after``, then its new ones as they are committed, until
        it ends; ``None`` every ``keepalive_s`` of silence (a keepalive comment)."""
        live = self.live.get(job_id)
        if live is None:
            last = self._unrecorded.get(job_id)
            try:
                for event in await self.store.events(job_id, after):
                    yield event
                    after = event.seq
            except StoreUnavailable:
                if last is None:
                    raise
            if last is not None and last.seq > after:
                yield last
            return
        while True:
            while after < len(live.events):
                # One at a time: more events may be committed while this one is sent.
                event = live.events[after]
                after = event.seq
                yield event
            if live.finished or self.stopped:
                return
            waiting = live.changed
            with trio.move_on_after(keepalive_s) as quiet:
                await waiting.wait()
            if quiet.cancelled_caught:
                yield None

    async def wait(self, job_id: str) -> str | None:
        """Wait for the job to end; returns why it ended unrecorded, else None."""
        live = self.live.get(job_id)
        if live is None:
            last = self._unrecorded.get(job_id)
            return None if last is None else str(last.data["message"])
        await live.done.wait()
        return live.unrecorded

    # --- one job ---------------------------------------------------------------------------------
    def _client_for(self, job: Job) -> ChatClient:
        """The chat client of ``job``'s calls: each is the call of the client that started it
        (its row keeps the name, so a resumed job's calls are still that client's)."""
        assert self.client is not None
        return self.client if job.client is None else ForClient(self.client, job.client)

    async def _run(self, job: Job, live: LiveJob) -> None:
        job_id = live.job_id

        order = trio.Lock()

        async def emit(event: JobEvent) -> None:
            # One event of a job at a time: its number is its place in the stream, and a
            # follower must never see event n+1 before event n is committed.
            async with order:
                seq = len(live.events) + 1
                stored = await self.store.append(job_id, seq, event.type, event.data())
                live.events.append(stored)
            live.notify()

        async def fail(message: str) -> None:
            with trio.CancelScope(shield=True):
                try:
                    await emit(Failed(message))
                    await self.store.update_job(
                        job_id, status="error", error=message, finished_at=self.store.now()
                    )
                except Exception as exc:
                    # The end cannot be written either: tell the live followers, not durably.
                    # The row still names the last stage recorded; the next start resumes it.
                    cause = exc.message if isinstance(exc, StoreUnavailable) else repr(exc)
                    log.error("council job %s ended unrecorded: %s", job_id, cause)
                    text = message if cause in message else f"{message} (not recorded: {cause})"
                    live.unrecorded = text
                    failed = Failed(text, recorded=False)
                    last = Event(job_id, len(live.events) + 1, self.store.now(), failed.type,
                                 failed.data())  # fmt: skip
                    live.events.append(last)
                    self._unrecorded[job_id] = last
                    while len(self._unrecorded) > UNRECORDED_KEPT:
                        self._unrecorded.popitem(last=False)

        try:
            # Each stage released its programs as it ended (pipeline.in_context): a client
            # that sees the job end finds them gone.
            await self._stages(job, emit)
            await self.store.update_job(job_id, status="complete", finished_at=self.store.now())
            await emit(Complete())
        except Exception as exc:
            # A stage's nursery wraps what its tasks raised in an ExceptionGroup: the client is
            # told the causes themselves, not the group's repr.
            causes = leaves(exc)
            failed = [c for c in causes if isinstance(c, JobFailed)]
            store = [c for c in causes if isinstance(c, StoreUnavailable)]
            if failed:
                await fail(failed[0].message)
            elif store:
                await fail(
                    "The council job stopped: it could not record its progress in the audit "
                    "db. " + store[0].message
                )
            else:
                log.exception("council job %s failed", job_id)
                plain = "; ".join(f"{type(c).__name__}: {c}" for c in causes)
                await fail(f"The council job failed unexpectedly ({plain}); see the proxy's log.")
        finally:
            live.finished = True
            self.live.pop(job_id, None)
            self._client_of.pop(job_id, None)
            if self._by_conversation.get(live.conversation_id) == job_id:
                del self._by_conversation[live.conversation_id]
            live.done.set()
            live.notify()

    async def _stages(self, job: Job, emit: pipeline.Emit) -> None:
        client = self._client_for(job)
        store = self.store
        job_id = job.id
        question = job.question
        # The job row keeps the council it was started with, so a resumed job after a
        # configuration change still finishes with the same members.
        config = CouncilConfig(
            members=job.members,
            chairman=job.chairman,
            title_model=job.title_model or self.config.title_model,
            member_timeout_s=self.config.member_timeout_s,
            tool_rounds=self.config.tool_rounds,
            max_tokens=self.config.max_tokens,
        )
        done = job.completed_stage
        conversation = await store.get_conversation(job.conversation_id)
        earlier = (conversation or {}).get("messages", [])
        # Only the turns before this job's own question count as history.
        for index, message in enumerate(earlier):
            if message.get("job_id") == job_id:
                earlier = earlier[: max(0, index - 1)]
                break
        turns = deliberation.turns_from_messages(earlier)
        if job.last_seq:
            await store.update_job(job_id, resumes=job.resumes + 1)
            await emit(Resumed(done))
        metadata: dict[str, Any] = dict(job.metadata or {})

        if done < 1:
            await store.update_job(job_id, status="stage1")
            answers, failed = await pipeline.stage1(
                client, config, job_id, question, turns, emit, self.toolbox
            )
            metadata["failed_members"] = failed
            await store.update_job(
                job_id, stage1=answers_json(answers), completed_stage=1, metadata=metadata
            )
            await emit(Stage1Complete(tuple(answers), tuple(failed)))
        else:
            answers = list(job.stage1 or ())

        if done < 2:
            await store.update_job(job_id, status="stage2")
            rankings, label_to_model, failed2 = await pipeline.stage2(
                client, config, job_id, question, answers, emit
            )
            standings = deliberation.aggregate(rankings, label_to_model)
            metadata.update(
                label_to_model=label_to_model,
                aggregate_rankings=standings_json(standings),
                failed_rankers=failed2,
            )
            await store.update_job(
                job_id, stage2=rankings_json(rankings), completed_stage=2, metadata=metadata
            )
            await emit(
                Stage2Complete(tuple(rankings), label_to_model, tuple(standings), tuple(failed2))
            )
        else:
            rankings = list(job.stage2 or ())
            standings = job.standings()

        if done < 3:
            await store.update_job(job_id, status="stage3")
            stage3 = await pipeline.stage3(
                client, config, job_id, question, turns, answers, rankings, standings, emit
            )
            await store.update_job(job_id, stage3=stage3, completed_stage=3)
            await emit(Stage3Complete(stage3))

        if job.title_model:
            name = await pipeline.title(client, config, job_id, question)
            if name:
                await store.set_title(job.conversation_id, name)
                await emit(TitleComplete(name))
