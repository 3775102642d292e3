"""One error tree for the whole proxy, and one table (``ERRORS``, at the end) giving each class
its HTTP status and OpenAI error type; http/errors.py renders them.

    ThunderproxyError
      ConfigError                   a setting or flag is wrong; raised before anything starts
      AuditError                    the SQLite audit db cannot be opened or migrated
      NotReady                      still starting: backends have not answered /health (503)
      RequestError                  the client's request cannot be served as sent
        InvalidRequest              malformed JSON, wrong types (400)
        Unauthorized                admin token missing or wrong (401)
          ClientUnauthorized        no client key, or one no [clients] entry holds (401)
        Forbidden                   a path the proxy never relays without the admin token (403)
        NotFound                    no such route (404)
        ModelNotFound               no backend serves the requested model (404, vLLM's shape)
        MethodNotAllowed            the route exists, the method does not (405)
        RequestTimeout              the body did not arrive within --client-timeout (408)
        BodyIncomplete              the client left before its body was whole (499, recorded
                                    only: nobody is left to answer)
        PayloadTooLarge             body over the configured limit (413)
        HeadersTooLarge             request head over the configured limit (431)
      SchedulingError
        ProgramUnknown              a program id the registry does not know (404)
        ProfilingDisabled           /profiles asked while --no-profile (400)
        ProgramReleased             the program was released while its request waited (409)
        QueueFull                   the wait for capacity would exceed the bound (429)
          RateLimited               a model's rate limit held the call past its class's wait (429)
      ProxyStopping                 the proxy shut down before the call ended (503)
      ShuttingDown                  a request that arrived after SIGTERM/SIGINT (503)
      BackendError                  the upstream could not answer properly
        NoBackendAvailable          no healthy backend to send to (503)
        BackendUnavailable          connection refused or reset (502)
        BackendTimeout              no answer within the configured timeout (504)
        BackendProtocolError        the upstream answered something unreadable (502)
        OutOfDescriptors            the proxy itself had no file descriptor for the connection
                                    (503; never counted against the backend's health)

Every message names the thing that failed and, where there is one, the remedy.
"""

from __future__ import annotations

from collections.abc import Sequence


class ThunderproxyError(Exception):
    """Base of every error thunderproxy raises on purpose."""

    #: OpenAI-style ``param`` the error is about, if any.
    param: str | None = None

    def __init__(
        self, message: str, *, param: str | None = None, program_id: str | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        if param is not None:
            self.param = param
        #: The program the failed request belonged to, when known.
        self.program_id = program_id


class ConfigError(ThunderproxyError):
    """A setting is invalid; the message names the setting and a valid value."""


class AuditError(ThunderproxyError):
    """The audit database cannot be opened, migrated or written."""


class NotReady(ThunderproxyError):
    """The proxy listens but does not serve LLM calls yet: its backends have not answered
    /health (for at most --ready-timeout). Clients retry after ``retry_after_s``."""

    def __init__(self, message: str, *, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class RequestError(ThunderproxyError):
    pass


class InvalidRequest(RequestError):
    pass


class Unauthorized(RequestError):
    pass


class ClientUnauthorized(Unauthorized):
    """A call to an LLM, council or passthrough route without a key of a configured client
    (``[clients]``, docs/CONFIG.md): refused before anything else is read from it."""


class Forbidden(RequestError):
    pass


class NotFound(RequestError):
    pass


class ModelNotFound(RequestError):
    """No backend serves ``model``; the message lists what is served (vLLM's 404)."""

    def __init__(self, model: str, served: Sequence[str]) -> None:
        listed = ", ".join(served) if served else "none yet: the backends have not answered"
        super().__init__(
            f"The model `{model}` does not exist. Served models: {listed}. Ask for one of them, "
            "or send other names to one with the proxy's --default-model or an [aliases] "
            'pattern ("claude-*" = "<served model>").',
            param="model",
        )
        self.model = model


class MethodNotAllowed(RequestError):
    pass


class RequestTimeout(RequestError):
    pass


class BodyIncomplete(RequestError):
    pass


class PayloadTooLarge(RequestError):
    pass


class HeadersTooLarge(RequestError):
    pass


class SchedulingError(ThunderproxyError):
    pass


class ProgramUnknown(SchedulingError):
    def __init__(self, program_id: str) -> None:
        super().__init__(
            f"Program {program_id!r} is not tracked; GET /programs lists the known programs.",
            param="program_id",
            program_id=program_id,
        )


class ProfilingDisabled(SchedulingError):
    def __init__(self) -> None:
        super().__init__("Profiling is disabled; start thunderproxy with --profile to enable it.")


class QueueFull(SchedulingError):
    def __init__(
        self, message: str, *, retry_after_s: float, program_id: str | None = None
    ) -> None:
        super().__init__(message, program_id=program_id)
        self.retry_after_s = retry_after_s


class RateLimited(QueueFull):
    """A call over its model's limits (docs/LIMITS.md) waited its class's ``max_wait`` and still
    did not fit; ``retry_after_s`` is when the binding window closes."""


class ProgramReleased(SchedulingError):
    pass


class ProxyStopping(ThunderproxyError):
    """The proxy is shutting down and ended a call it could not finish within the grace."""


class ShuttingDown(ThunderproxyError):
    """A request that arrived after SIGTERM/SIGINT: refused at once, with Retry-After and
    ``Connection: close``, so the client retries elsewhere (or once the proxy is back)."""


class BackendError(ThunderproxyError):
    def __init__(self, message: str, *, backend: str | None = None) -> None:
        super().__init__(message)
        self.backend = backend


class NoBackendAvailable(BackendError):
    pass


class BackendUnavailable(BackendError):
    pass


class BackendTimeout(BackendError):
    pass


class BackendProtocolError(BackendError):
    pass


class OutOfDescriptors(BackendError):
    """The proxy could not open a connection to a backend because it is out of file
    descriptors (EMFILE, ENFILE): its own trouble, so the backend stays healthy."""


#: Every error class the proxy answers with: (HTTP status, OpenAI error ``type``). Subclasses
#: not listed take their nearest listed ancestor's entry.
ERRORS: dict[type[ThunderproxyError], tuple[int, str]] = {
    ThunderproxyError: (500, "internal_error"),
    InvalidRequest: (400, "invalid_request_error"),
    ProfilingDisabled: (400, "invalid_request_error"),
    Unauthorized: (401, "authentication_error"),
    ClientUnauthorized: (401, "authentication_error"),
    Forbidden: (403, "permission_error"),
    NotFound: (404, "not_found_error"),
    # vLLM's own answer for a model it does not serve.
    ModelNotFound: (404, "NotFoundError"),
    ProgramUnknown: (404, "not_found_error"),
    MethodNotAllowed: (405, "invalid_request_error"),
    RequestTimeout: (408, "timeout_error"),
    ProgramReleased: (409, "conflict_error"),
    # nginx's status for a client that closed the connection before it could be answered.
    BodyIncomplete: (499, "client_closed_request"),
    PayloadTooLarge: (413, "invalid_request_error"),
    QueueFull: (429, "rate_limit_error"),
    RateLimited: (429, "rate_limit_error"),
    HeadersTooLarge: (431, "invalid_request_error"),
    ConfigError: (500, "config_error"),
    AuditError: (500, "audit_error"),
    BackendError: (502, "backend_error"),
    BackendUnavailable: (502, "backend_error"),
    BackendProtocolError: (502, "backend_error"),
    NoBackendAvailable: (503, "service_unavailable"),
    OutOfDescriptors: (503, "service_unavailable"),
    NotReady: (503, "service_unavailable"),
    ProxyStopping: (503, "service_unavailable"),
    ShuttingDown: (503, "service_unavailable"),
    BackendTimeout: (504, "timeout_error"),
}


def describe(error: ThunderproxyError) -> tuple[int, str]:
    """``(status, type)`` of ``error``, from :data:`ERRORS`."""
    for cls in type(error).__mro__:
        entry = ERRORS.get(cls)
        if entry is not None:
            return entry
    return ERRORS[ThunderproxyError]


def reason(error: ThunderproxyError) -> str:
    """Why ``error`` refused a call, as a metric label: its class's name in snake case
    (``ModelNotFound`` -> ``model_not_found``), a value from this module's bounded set."""
    name = type(error).__name__ if type(error).__module__ == __name__ else "ThunderproxyError"
    return "".join(f"_{c.lower()}" if c.isupper() else c for c in name).lstrip("_")


def our_error(exc: BaseException) -> ThunderproxyError | None:
    """The ThunderproxyError behind ``exc``, also when nurseries wrapped it in groups."""
    if isinstance(exc, ThunderproxyError):
        return exc
    if isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        return our_error(exc.exceptions[0])
    return None
