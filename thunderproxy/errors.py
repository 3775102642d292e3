"""One error tree for the whole proxy; HTTP status codes are assigned only in http/errors.py.

    ThunderproxyError
      ConfigError                   a setting or flag is wrong; raised before anything starts
      AuditError                    the SQLite audit db cannot be opened or migrated
      NotReady                      still starting: backends have not answered /health (503)
      RequestError                  the client's request cannot be served as sent
        InvalidRequest              malformed JSON, wrong types (400)
        PayloadTooLarge             body over the configured limit (413)
        HeadersTooLarge             request head over the configured limit (431)
        Unauthorized                admin token missing or wrong (401)
      SchedulingError
        ProgramUnknown              a program id the registry does not know (404)
        ProfilingDisabled           /profiles asked while --no-profile (400)
        QueueFull                   the wait for capacity would exceed the bound (429)
        ProgramReleased             the program was released while its request waited (409)
      BackendError                  the upstream could not answer properly
        NoBackendAvailable          no healthy backend to send to (503)
        BackendUnavailable          connection refused or reset (502)
        BackendTimeout              no answer within the configured timeout (504)
        BackendProtocolError        the upstream answered something unreadable (502)

Every message names the thing that failed and, where there is one, the remedy.
"""

from __future__ import annotations


class ThunderproxyError(Exception):
    """Base of every error thunderproxy raises on purpose."""

    #: OpenAI-style error ``type`` reported to clients.
    error_type = "internal_error"
    #: OpenAI-style ``param`` the error is about, if any.
    param: str | None = None
    #: The program the failed request belonged to, when known.
    program_id: str | None = None
    #: Set once the failure is in the audit log as a step, so it is not logged twice.
    step_recorded = False

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if param is not None:
            self.param = param


class ConfigError(ThunderproxyError):
    """A setting is invalid; the message names the setting and a valid value."""

    error_type = "config_error"


class AuditError(ThunderproxyError):
    """The audit database cannot be opened, migrated or written."""

    error_type = "audit_error"


class NotReady(ThunderproxyError):
    """The proxy listens but does not serve LLM calls yet: its backends have not answered
    /health (for at most --ready-timeout). Clients retry after ``retry_after_s``."""

    error_type = "service_unavailable"

    def __init__(self, message: str, *, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class RequestError(ThunderproxyError):
    error_type = "invalid_request_error"


class InvalidRequest(RequestError):
    pass


class PayloadTooLarge(RequestError):
    pass


class HeadersTooLarge(RequestError):
    pass


class Unauthorized(RequestError):
    error_type = "authentication_error"


class SchedulingError(ThunderproxyError):
    error_type = "scheduling_error"


class ProgramUnknown(SchedulingError):
    error_type = "not_found_error"

    def __init__(self, program_id: str) -> None:
        super().__init__(
            f"Program {program_id!r} is not tracked; GET /programs lists the known programs.",
            param="program_id",
        )
        self.program_id: str | None = program_id


class ProfilingDisabled(SchedulingError):
    error_type = "invalid_request_error"

    def __init__(self) -> None:
        super().__init__("Profiling is disabled; start thunderproxy with --profile to enable it.")


class QueueFull(SchedulingError):
    error_type = "rate_limit_error"

    def __init__(self, message: str, *, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ProgramReleased(SchedulingError):
    error_type = "conflict_error"


class BackendError(ThunderproxyError):
    error_type = "backend_error"

    def __init__(self, message: str, *, backend: str | None = None) -> None:
        super().__init__(message)
        self.backend = backend


class NoBackendAvailable(BackendError):
    error_type = "service_unavailable"


class BackendUnavailable(BackendError):
    pass


class BackendTimeout(BackendError):
    error_type = "timeout_error"


class BackendProtocolError(BackendError):
    pass
