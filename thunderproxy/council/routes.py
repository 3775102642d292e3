"""The council's HTTP face, as a Quart blueprint under ``/council``: the page, conversations,
messages (whole answer or SSE), and a job's status and replayable stream.

Routes only translate HTTP into runner and store calls. Stream events carry ``id: <seq>``; a
client that reconnects with ``?after=N`` or ``Last-Event-ID: N`` gets every later event, also
after the job ended and after a restart.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import aclosing
from importlib import resources
from typing import Any

from quart import Blueprint, Response, jsonify, request

from ..errors import InvalidRequest, ThunderproxyError
from ..http.auth import require_admin
from ..http.clients import client_of
from ..http.errors import error_body
from ..http.validate import parse_integer
from .errors import ConversationUnknown, JobFailed, JobRunning, StoreUnavailable, describe
from .runner import CouncilRunner
from .store import JobStore

#: Longest question accepted, in characters (the page counts down to it).
MAX_QUESTION_CHARS = 20_000
STATIC_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
}


def _static(name: str) -> bytes | None:
    # Package data, read through importlib.resources: works from a wheel or the zipapp.
    entry = resources.files("thunderproxy.council") / "static" / name
    return entry.read_bytes() if entry.is_file() else None


def sse(event: dict[str, Any], seq: int) -> bytes:
    return f"id: {seq}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n".encode()


def caller() -> str | None:
    """Who the caps on running jobs count: the client's name with [clients]; else its
    address, which is all there is to count."""
    return client_of(request.scope) or request.remote_addr


async def conversation_or_404(store: JobStore, conversation_id: str) -> dict[str, Any]:
    conversation = await store.get_conversation(conversation_id)
    if conversation is None:
        raise ConversationUnknown(conversation_id)
    return conversation


async def question() -> str:
    """The question the request's JSON body asks, checked."""
    try:
        body = json.loads(await request.get_data(as_text=True) or "{}")
    except ValueError:
        raise InvalidRequest('Send JSON: {"content": "your question"}.') from None
    content = body.get("content") if isinstance(body, dict) else None
    if not isinstance(content, str) or not content.strip():
        raise InvalidRequest('"content" must be a non-empty string.', param="content")
    if len(content) > MAX_QUESTION_CHARS:
        raise InvalidRequest(
            f"The question is longer than {MAX_QUESTION_CHARS} characters.", param="content"
        )
    return content


def stream(runner: CouncilRunner, job_id: str, after: int, keepalive_s: float) -> Response:
    """The job's events after ``after`` as SSE, then its new ones until it ends."""

    async def body() -> AsyncIterator[bytes]:
        # A comment first, so the client sees the stream is open before any event.
        yield b": council job " + job_id.encode() + b"\n\n"
        # Closed explicitly: a client that leaves must not leave the follower to the GC.
        async with aclosing(runner.follow(job_id, after, keepalive_s=keepalive_s)) as events:
            async for event in events:
                if event is None:
                    yield b": keepalive\n\n"
                else:
                    yield sse({**event.payload(), "job_id": job_id}, event.seq)

    response = Response(body(), content_type="text/event-stream; charset=utf-8")
    response.headers["cache-control"] = "no-cache"
    response.headers["x-accel-buffering"] = "no"
    response.timeout = None
    return response


def create_blueprint(
    runner: CouncilRunner, *, admin_token: str = "", keepalive_s: float = 15.0
) -> Blueprint:
    bp = Blueprint("council", __name__, url_prefix="/council")
    _guard(bp, runner, admin_token)
    _page_routes(bp, runner)
    _conversation_routes(bp, runner)
    _job_routes(bp, runner, keepalive_s)
    return bp


def _guard(bp: Blueprint, runner: CouncilRunner, admin_token: str) -> None:
    """Errors in the council's shape; the token (or a client's key) before any route."""

    @bp.errorhandler(ThunderproxyError)
    async def handle_error(error: ThunderproxyError) -> Response:
        status, error_type = describe(error)
        if isinstance(error, JobFailed) and not runner.ready:
            status = 503
        body = error_body(error.message, error_type=error_type, status=status, param=error.param)
        response = Response(body, status=status, content_type="application/json")
        if status == 401:
            # Lets a browser ask for the token (any user name, the token as password).
            response.headers["www-authenticate"] = 'Basic realm="thunderproxy council"'
        return response

    @bp.before_request
    async def check_token() -> None:
        # Council jobs spend backend time and conversations are private: with an admin token
        # set, the whole council (page included) needs it, or with [clients] a client's key
        # (checked by the app before this hook: http/clients.py).
        if client_of(request.scope) is None:
            require_admin(request.headers.get("authorization"), admin_token)


def _page_routes(bp: Blueprint, runner: CouncilRunner) -> None:
    """The page, its static files, and the council it shows."""

    @bp.get("/")
    async def page() -> Response:
        return Response(_static("index.html") or b"", content_type=STATIC_TYPES[".html"])

    @bp.get("/static/<name>")
    async def static(name: str) -> Response:
        suffix = name[name.rfind(".") :] if "." in name else ""
        data = _static(name) if "/" not in name and suffix in STATIC_TYPES else None
        if data is None:
            return Response(b"not found", status=404)
        return Response(data, content_type=STATIC_TYPES[suffix])

    @bp.get("/api/config")
    async def config() -> Response:
        council = runner.config
        return jsonify(
            {
                "members": list(council.members),
                "chairman": council.chairman,
                "title_model": council.title_model,
                "tools": [t["function"]["name"] for t in runner.toolbox.definitions()]
                if runner.toolbox
                else [],
            }
        )


def _conversation_routes(bp: Blueprint, runner: CouncilRunner) -> None:
    store = runner.store

    @bp.get("/api/conversations")
    async def list_conversations() -> Response:
        return jsonify(await store.list_conversations())

    @bp.post("/api/conversations")
    async def create_conversation() -> Response:
        return jsonify(await store.create_conversation())

    @bp.get("/api/conversations/<conversation_id>")
    async def get_conversation(conversation_id: str) -> Response:
        return jsonify(await conversation_or_404(store, conversation_id))

    @bp.delete("/api/conversations/<conversation_id>")
    async def delete_conversation(conversation_id: str) -> Response:
        running = runner.running_job(conversation_id)
        if running is not None:
            raise JobRunning(conversation_id, running)
        if not await store.delete_conversation(conversation_id):
            raise ConversationUnknown(conversation_id)
        return jsonify({"id": conversation_id, "deleted": True})


def _job_routes(bp: Blueprint, runner: CouncilRunner, keepalive_s: float) -> None:
    """Asking (whole answer or stream) and following a conversation's jobs."""
    store = runner.store

    @bp.post("/api/conversations/<conversation_id>/message")
    async def message(conversation_id: str) -> tuple[Response, int]:
        await conversation_or_404(store, conversation_id)
        content = await question()
        job_id = await runner.start(
            conversation_id, content, client=caller(), owner=client_of(request.scope)
        )
        unrecorded = await runner.wait(job_id)
        if unrecorded is not None:
            # The job could not record how it ended: the db refused its writes.
            raise StoreUnavailable(unrecorded)
        job = await store.get_job(job_id)
        assert job is not None
        return jsonify(job.result()), 200 if job.status == "complete" else 502

    @bp.post("/api/conversations/<conversation_id>/message/stream")
    async def message_stream(conversation_id: str) -> Response:
        await conversation_or_404(store, conversation_id)
        content = await question()
        job_id = await runner.start(
            conversation_id, content, client=caller(), owner=client_of(request.scope)
        )
        return stream(runner, job_id, 0, keepalive_s)

    @bp.get("/api/conversations/<conversation_id>/job/status")
    async def job_status(conversation_id: str) -> Response:
        await conversation_or_404(store, conversation_id)
        job_id = await store.latest_job(conversation_id)
        job = None if job_id is None else await store.get_job(job_id)
        if job is None:
            return jsonify({"active": False, "job_id": None})
        return jsonify(
            {
                "active": runner.running_job(conversation_id) == job_id,
                "job_id": job_id,
                "status": job.status,
                "completed_stage": job.completed_stage,
                "events": job.last_seq,
                "error": job.error,
            }
        )

    @bp.get("/api/conversations/<conversation_id>/job/stream")
    async def job_stream(conversation_id: str) -> Response:
        await conversation_or_404(store, conversation_id)
        name, raw = "after", request.args.get("after")
        if not raw:
            name, raw = "last-event-id", request.headers.get("last-event-id") or "0"
        # Bounded before the stream starts: past SQLite's range it failed mid-stream.
        after = parse_integer(raw, name)
        job_id = request.args.get("job_id") or await store.latest_job(conversation_id)
        if job_id is None:
            raise InvalidRequest(f"Conversation {conversation_id!r} has no council job yet.")
        job = await store.get_job(job_id)
        if job is None or job.conversation_id != conversation_id:
            raise InvalidRequest(
                f"Council job {job_id!r} is not a job of conversation {conversation_id!r}; "
                "leave job_id out to follow its latest job.",
                param="job_id",
            )
        return stream(runner, job_id, after, keepalive_s)
