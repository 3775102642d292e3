"""The [limits] section: values as written, and errors that name the key and the remedy."""

from __future__ import annotations

from pathlib import Path

import pytest

from thunderproxy.admission.spec import ModelLimits
from thunderproxy.config import load_settings
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
