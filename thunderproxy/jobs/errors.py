"""The council's errors, in the one tree of ``thunderproxy.errors``.

ThunderproxyError
  RequestError
    ConversationUnknown     no conversation with that id (404)
    JobRunning              a council job already runs for the conversation (409)
  JobFailed                 the council could not answer at all (no member answered)
  MemberFailed              one member's call failed; the council leaves it out
  ToolFailed                a tool call could not be carried out; its text goes to the model
"""

from __future__ import annotations

from ..errors import RequestError, ThunderproxyError


class ConversationUnknown(RequestError):
    error_type = "not_found_error"

    def __init__(self, conversation_id: str) -> None:
        super().__init__(
            f"Conversation {conversation_id!r} does not exist; GET /council/api/conversations "
            "lists them, POST there creates one.",
            param="conversation_id",
        )


class JobRunning(RequestError):
    error_type = "conflict_error"

    def __init__(self, conversation_id: str, job_id: str) -> None:
        super().__init__(
            f"Conversation {conversation_id!r} already has council job {job_id!r} running; "
            f"follow it at /council/api/conversations/{conversation_id}/job/stream or wait "
            "for it to finish."
        )
        self.job_id = job_id


class JobFailed(ThunderproxyError):
    error_type = "council_error"


class MemberFailed(ThunderproxyError):
    error_type = "backend_error"


class ToolFailed(ThunderproxyError):
    error_type = "tool_error"
