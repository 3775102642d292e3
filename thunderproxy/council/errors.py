"""The council's errors, in the one tree of ``thunderproxy.errors``.

ThunderproxyError
  RequestError
    ConversationUnknown     no conversation with that id (404)
    JobRunning              a council job already runs for the conversation (409)
    TooManyJobs             the client, or all clients together, have as many jobs running
                            as allowed (429)
  JobFailed                 the council could not answer at all (no member answered)
  StoreUnavailable          the council's tables cannot be written, even after retries (503)
  MemberFailed              one member's call failed; the council leaves it out
  ToolFailed                a tool call could not be carried out; its text goes to the model

Their HTTP status and OpenAI error type are in ``COUNCIL_ERRORS``; every other error is
described by the proxy's own table.
"""

from __future__ import annotations

from ..errors import RequestError, ThunderproxyError
from ..errors import describe as describe_proxy_error


class ConversationUnknown(RequestError):
    def __init__(self, conversation_id: str) -> None:
        super().__init__(
            f"Conversation {conversation_id!r} does not exist; GET /council/api/conversations "
            "lists them, POST there creates one.",
            param="conversation_id",
        )


class JobRunning(RequestError):
    def __init__(self, conversation_id: str, job_id: str) -> None:
        super().__init__(
            f"Conversation {conversation_id!r} already has council job {job_id!r} running; "
            f"follow it at /council/api/conversations/{conversation_id}/job/stream or wait "
            "for it to finish."
        )
        self.job_id = job_id


class TooManyJobs(RequestError):
    """A new job would pass ``--council-max-jobs`` or ``--council-max-jobs-per-client``."""


class JobFailed(ThunderproxyError):
    """The council could not answer at all."""


class StoreUnavailable(ThunderproxyError):
    """The council's tables in the audit db refused a statement, even after retries."""


class MemberFailed(ThunderproxyError):
    """One member's call failed; the message names the model and what happened."""


class ToolFailed(ThunderproxyError):
    """A tool call could not be carried out; its message is what the model is told."""


COUNCIL_ERRORS: dict[type[ThunderproxyError], tuple[int, str]] = {
    ConversationUnknown: (404, "not_found_error"),
    JobRunning: (409, "conflict_error"),
    TooManyJobs: (429, "rate_limit_error"),
    JobFailed: (502, "council_error"),
    StoreUnavailable: (503, "service_unavailable"),
}


def describe(error: ThunderproxyError) -> tuple[int, str]:
    """``(status, type)`` of an error raised on a council route."""
    for cls in type(error).__mro__:
        entry = COUNCIL_ERRORS.get(cls)
        if entry is not None:
            return entry
    return describe_proxy_error(error)
