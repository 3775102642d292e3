"""The one error table: every error class the proxy raises has a status and an OpenAI type, and
http/errors.py renders them in OpenAI's shape."""

from __future__ import annotations

import json

import pytest

from thunderproxy import errors
from thunderproxy.errors import ERRORS, ThunderproxyError, describe
from thunderproxy.http.errors import error_json, error_response, sse_error_event


def every_error_class() -> list[type[ThunderproxyError]]:
    found: list[type[ThunderproxyError]] = []
    todo: list[type[ThunderproxyError]] = [ThunderproxyError]
    while todo:
        cls = todo.pop()
        found.append(cls)
        todo.extend(cls.__subclasses__())
    return [c for c in found if c.__module__ == errors.__name__ and not c.__subclasses__()]


@pytest.mark.parametrize("cls", every_error_class(), ids=lambda c: c.__name__)
def test_every_error_raised_has_its_own_entry(cls: type[ThunderproxyError]) -> None:
    assert cls in ERRORS, f"add {cls.__name__} to errors.ERRORS"


def test_a_subclass_not_listed_takes_its_ancestors_entry() -> None:
    class Special(errors.BackendTimeout):
        pass

    assert describe(Special("slow")) == (504, "timeout_error")


def test_the_json_shape_is_openais() -> None:
    error = errors.ModelNotFound("gpt-9", ["a", "b"])
    body = json.loads(error_json(error))
    assert body == {
        "error": {
            "message": "The model `gpt-9` does not exist. Served models: a, b. Ask for one of "
            "them, or send other names to one with the proxy's --default-model or an [aliases] "
            'pattern ("claude-*" = "<served model>").',
            "type": "NotFoundError",
            "param": "model",
            "code": 404,
        }
    }
    event = sse_error_event(errors.BackendUnavailable("gone"))
    assert event.endswith(b"data: [DONE]\n\n")
    assert json.loads(event.split(b"\n\n")[0][6:])["error"]["code"] == 502


def test_a_full_queue_says_when_to_retry() -> None:
    response = error_response(errors.QueueFull("wait", retry_after_s=2.2))
    assert response.status_code == 429
    assert response.headers["retry-after"] == "3"
