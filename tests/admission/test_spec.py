"""The [limits] section: values as written, and errors that name the key and the remedy."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from thunderproxy.config import load_settings
from thunderproxy.config.limits import ModelLimits
from thunderproxy.errors import ConfigError

GOOD = """
[limits]
default_class = "interactive"

[limits.models.qwen-32b]
rpm = 600
tpm = 200000
concurrent = 32

[limits.classes.interactive]
ratio = 0.6
flexible = false
max_wait = 5

[limits.classes.batch]
ratio = 0.4
max_wait = 120
"""


def load(tmp_path: Path, text: str) -> object:
    path = tmp_path / "thunderproxy.toml"
    path.write_text(text)
    return load_settings(config=str(path))


def test_the_worked_example_loads(tmp_path: Path) -> None:
    settings = load(tmp_path, GOOD)
    limits = settings.limits  # type: ignore[attr-defined]
    assert limits.models["qwen-32b"] == ModelLimits(rpm=600, tpm=200_000, concurrent=32)
    assert [(c.name, c.ratio, c.flexible, c.max_wait_s) for c in limits.classes] == [
        ("interactive", 0.6, False, 5.0),
        ("batch", 0.4, True, 120.0),
    ]
    assert settings.public()["limits"]["models"]["qwen-32b"]["rpm"] == 600  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "[limits.models.m]\nrpn = 5\n",
            "limits.models.m.rpn: unknown key; known keys: rpm, tpm, rpd, tpd, concurrent",
        ),
        ("[limits.models.m]\nrpm = 0\n", "limits.models.m.rpm: expected a positive integer"),
        ("[limits.models.m]\n", "limits.models.m: no limits given; set at least one of"),
        (
            "[limits.classes.a]\nratio = 0.5\n[limits.classes.b]\nratio = 0.4\n",
            "limits.classes: the ratios add up to 0.9, not 1; give the classes ratios",
        ),
        (
            '[limits]\ndefault_class = "x"\n[limits.classes.a]\nratio = 1\n',
            "limits.default_class: 'x' is not a class; name one of: a",
        ),
        ("[limits.classes.a]\nratio = 1\nmax_wait = -1\n", "limits.classes.a.max_wait"),
    ],
)
def test_mistakes_name_the_key_and_the_remedy(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load(tmp_path, text)
    assert message in str(info.value)


BACKENDS = """
[[backends]]
url = "http://127.0.0.1:8001"
name = "gpu0"

[[backends]]
url = "http://127.0.0.1:8002"

[limits.backends.gpu0]
rpm = 100

[limits.backends."http://127.0.0.1:8002"]
tpm = 5000
concurrent = 4
"""


def test_backends_are_limited_by_name_or_url(tmp_path: Path) -> None:
    settings = load(tmp_path, BACKENDS)
    limits = settings.limits  # type: ignore[attr-defined]
    assert limits.backends == {
        "gpu0": ModelLimits(rpm=100),
        "http://127.0.0.1:8002": ModelLimits(tpm=5000, concurrent=4),
    }
    public = settings.public()["limits"]["backends"]  # type: ignore[attr-defined]
    assert public["gpu0"] == {"rpm": 100}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            BACKENDS.replace("rpm = 100", "rpn = 100"),
            "limits.backends.gpu0.rpn: unknown key; known keys: rpm, tpm, rpd, tpd, concurrent",
        ),
        (
            BACKENDS.replace("[limits.backends.gpu0]", "[limits.backends.gpu9]"),
            "limits.backends.gpu9: no configured backend has this URL or name; name one of: "
            "gpu0, http://127.0.0.1:8001, http://127.0.0.1:8002",
        ),
        (BACKENDS.replace("concurrent = 4", "concurrent = 0"), "concurrent: expected a positive"),
    ],
)
def test_backend_mistakes_name_the_key(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load(tmp_path, text)
    assert message in str(info.value)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            # 0.4 of 2 concurrent calls is 0.8: the class could never run a call.
            "[limits.models.m]\nconcurrent = 2\n"
            "[limits.classes.a]\nratio = 0.6\nflexible = false\n"
            "[limits.classes.b]\nratio = 0.4\nmax_wait = 120\n",
            "limits.classes.b.ratio: class 'b' (flexible, borrowing all it can) can never be "
            "admitted a call of m: 0.4 of limits.models.m.concurrent = 2 is 0.8, less than one "
            "call; raise limits.models.m.concurrent to at least 3, or the class's ratio.",
        ),
        (
            "[limits.models.m]\nrpm = 3\n"
            "[limits.classes.a]\nratio = 0.9\n[limits.classes.b]\nratio = 0.1\nflexible = false\n",
            "limits.classes.b.ratio: class 'b' (fixed) can never be admitted a call of m: 0.1 of "
            "limits.models.m.rpm = 3 is 0.3, less than one call; raise limits.models.m.rpm to at "
            "least 10, or the class's ratio (or make it flexible).",
        ),
    ],
)
def test_a_class_that_can_never_be_admitted_is_refused_at_start(
    tmp_path: Path, text: str, message: str
) -> None:
    with pytest.raises(ConfigError) as info:
        load(tmp_path, text)
    assert str(info.value).endswith(message)


def test_a_flexible_class_may_count_on_what_other_flexible_classes_lend(tmp_path: Path) -> None:
    # 0.4 of 2 is below one call, but the other class is flexible too: together they have 2.
    text = "[limits.models.m]\nconcurrent = 2\n[limits.classes.a]\nratio = 0.6\n"
    text += "[limits.classes.b]\nratio = 0.4\n"
    assert load(tmp_path, text).limits.models["m"].concurrent == 2  # type: ignore[attr-defined]


def test_serve_refuses_an_impossible_class_in_one_line(tmp_path: Path) -> None:
    config = tmp_path / "thunderproxy.toml"
    config.write_text(
        "[limits.models.m]\nconcurrent = 2\n[limits.classes.a]\nratio = 0.6\nflexible = false\n"
        "[limits.classes.b]\nratio = 0.4\n"
    )
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "thunderproxy",
            "serve",
            "--config",
            str(config),
            "--port",
            "0",
            "--db",
            str(tmp_path / "audit.db"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"Error: {config}: limits.classes.b.ratio: class 'b'")
    assert not (tmp_path / "audit.db").exists()  # nothing was started


def test_a_limit_on_a_model_no_backend_serves_is_refused(tmp_path: Path) -> None:
    backends = '[[backends]]\nurl = "http://127.0.0.1:8001"\nmodels = ["qwen-32b"]\n'
    with pytest.raises(ConfigError) as info:
        load(tmp_path, backends + "[limits.models.qwen-32B]\nrpm = 5\n")
    assert str(info.value).endswith(
        "limits.models.qwen-32B: 'qwen-32B' is served by no backend (served: qwen-32b); use a "
        "served model name (an alias's targets each have their own limits), or add it to a "
        "[[backends]] models list."
    )
    # Where a backend's models are only known from its /v1/models, nothing can be checked.
    unlisted = '[[backends]]\nurl = "http://127.0.0.1:8001"\n[limits.models.any]\nrpm = 5\n'
    assert load(tmp_path, unlisted).limits.models["any"].rpm == 5  # type: ignore[attr-defined]
