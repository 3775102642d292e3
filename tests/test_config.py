"""The settings table, the config file and its precedence, and every validation message."""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path
from typing import Any

import click
import pytest
from click.testing import CliRunner

from tests.conftest import query, running_proxy
from thunderproxy.cli import cli
from thunderproxy.config import (
    SECTIONS,
    SETTINGS,
    SETTINGS_BY_NAME,
    BackendSpec,
    PolicyConfig,
    Settings,
    given_values,
    load_settings,
    settings_options,
    settings_table,
)
from thunderproxy.errors import ConfigError
from thunderproxy.scheduling import tr

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def test_the_readme_table_is_the_generated_one() -> None:
    assert settings_table() in README


def test_every_setting_has_one_flag_one_env_var_and_a_default_matching_settings() -> None:
    serve = cli.commands["serve"]
    options = {p.name: p for p in serve.params if isinstance(p, click.Option)}
    defaults = Settings()
    for item in SETTINGS:
        option = options[item.name]
        if item.name == "sim":
            # NAME=VALUE pairs, repeatable; each has its own THUNDERPROXY_SIM_<NAME> variable.
            assert (option.envvar, option.multiple) == (None, True)
        else:
            assert option.envvar == "THUNDERPROXY_" + item.name.upper()
        assert item.flag in option.opts
        assert item.get(defaults) == item.default
    assert set(options) == set(SETTINGS_BY_NAME)


def test_the_policy_is_declared_once_nested_in_settings() -> None:
    assert tr.PolicyConfig is PolicyConfig
    assert SETTINGS_BY_NAME["pause_cooldown"].path == ("policy", "pause_cooldown_s")
    assert SETTINGS_BY_NAME["pause_cooldown"].flag == "--pause-cooldown"
    settings = load_settings(pause_cooldown=2.5, max_queue_wait=3.0, gate_returns=False)
    assert settings.policy == PolicyConfig(
        pause_cooldown_s=2.5, max_queue_wait_s=3.0, gate_returns=False
    )
    assert settings.value("pause_cooldown") == 2.5
    policy_fields = {f.name for f in dataclasses.fields(PolicyConfig)}
    assert policy_fields == {s.path[1] for s in SETTINGS if s.path[0] == "policy"}


def test_settings_stay_frozen_and_hashable_with_structured_values(tmp_path: Path) -> None:
    path = write(tmp_path, '[[backends]]\nurl = "http://a:1"\n[aliases]\nx = ["m"]\n')
    settings = load_settings(config=path)
    assert hash(settings) == hash(load_settings(config=path))
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.port = 1  # type: ignore[misc]
    with pytest.raises(TypeError):
        settings.aliases["y"] = ("m",)  # type: ignore[index]


def test_secrets_are_redacted_and_the_public_view_is_flat() -> None:
    public = load_settings(admin_token="s3cret", pause_cooldown=1.0).public()
    assert public["admin_token"] == "<redacted>"
    assert public["pause_cooldown"] == 1.0
    assert "s3cret" not in repr(load_settings(admin_token="s3cret"))


def write(tmp_path: Path, text: str, name: str = "thunderproxy.toml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


WORKED = """\
port = 8400
pause_cooldown = 3.0
gate_returns = false

[[backends]]
url = "http://gpu0:8000/"
models = ["qwen-32b"]
name = "gpu0"

[[backends]]
url = "http://gpu1:8000"
models = ["qwen-8b", "qwen-32b"]

[aliases]
coder = ["qwen-32b", "qwen-8b"]
"""


def test_a_worked_config_file(tmp_path: Path) -> None:
    settings = load_settings(config=write(tmp_path, WORKED))
    assert settings.port == 8400
    assert settings.policy.pause_cooldown_s == 3.0
    assert settings.policy.gate_returns is False
    assert settings.backend_specs == (
        BackendSpec("http://gpu0:8000", ("qwen-32b",), "gpu0"),
        BackendSpec("http://gpu1:8000", ("qwen-8b", "qwen-32b"), None),
    )
    assert settings.backends == ("http://gpu0:8000", "http://gpu1:8000")
    assert dict(settings.aliases) == {"coder": ("qwen-32b", "qwen-8b")}


def test_the_example_in_docs_config_loads(tmp_path: Path) -> None:
    text = (Path(__file__).resolve().parents[1] / "docs" / "CONFIG.md").read_text()
    example = re.search(r"```toml\n(.*?)```", text, re.S)
    assert example is not None
    settings = load_settings(config=write(tmp_path, example.group(1)))
    assert settings.backend_specs[0].models is not None
    assert settings.aliases


def test_backends_as_urls_and_from_the_flag(tmp_path: Path) -> None:
    as_string = load_settings(config=write(tmp_path, 'backends = "http://a:1, http://b:2/"\n'))
    assert as_string.backend_specs == (BackendSpec("http://a:1"), BackendSpec("http://b:2"))
    as_list = load_settings(config=write(tmp_path, 'backends = ["http://a:1"]\n'))
    assert as_list.backends == ("http://a:1",)
    # A --backends flag (or env var) replaces the file's backends, models and all.
    flagged = load_settings(backends="http://c:3", config=write(tmp_path, WORKED))
    assert flagged.backend_specs == (BackendSpec("http://c:3"),)
    assert load_settings(backends="http://c:3").backend_specs == (BackendSpec("http://c:3"),)


def test_sections_are_one_registry() -> None:
    assert set(SECTIONS) >= {"backends", "aliases"}
    assert all(callable(parser) for parser in SECTIONS.values())


# --- precedence: defaults < file < env < flags, through the real click options ---------------


@click.command()
@settings_options()
@click.pass_context
def probe(ctx: click.Context, /, **values: Any) -> None:
    given, origins = given_values(ctx, values)
    try:
        settings = load_settings(given, origins=origins)
    except ConfigError as exc:
        raise click.ClickException(exc.message) from None
    click.echo(f"{settings.port} {settings.host} {settings.policy.pause_cooldown_s}")


def probe_run(args: list[str], env: dict[str, str] | None = None) -> str:
    # The caller's own THUNDERPROXY_* variables must not leak into the test.
    isolated: dict[str, str | None] = {s.envvar: None for s in SETTINGS}
    isolated.update(env or {})
    result = CliRunner().invoke(probe, args, env=isolated, catch_exceptions=False)
    return result.output.strip()


def test_precedence_defaults_file_env_flags(tmp_path: Path) -> None:
    path = write(tmp_path, 'port = 8400\nhost = "0.0.0.0"\npause_cooldown = 3.0\n')
    assert probe_run([]) == "8300 127.0.0.1 5.0"
    assert probe_run(["--config", path]) == "8400 0.0.0.0 3.0"
    assert probe_run([], {"THUNDERPROXY_CONFIG": path}) == "8400 0.0.0.0 3.0"
    env = {"THUNDERPROXY_CONFIG": path, "THUNDERPROXY_PORT": "8500"}
    assert probe_run([], env) == "8500 0.0.0.0 3.0"
    assert probe_run(["--port", "8600", "--pause-cooldown", "1"], env) == "8600 0.0.0.0 1.0"
    # A flag equal to the default still beats the file: it was given.
    assert probe_run(["--config", path, "--port", "8300"]) == "8300 0.0.0.0 3.0"


def test_errors_say_where_the_value_came_from(tmp_path: Path) -> None:
    assert probe_run(["--port", "70000"]) == (
        "Error: --port: 70000 is not a TCP port: use 1-65535, or 0 for any free port."
    )
    assert probe_run([], {"THUNDERPROXY_PORT": "-1"}) == (
        "Error: THUNDERPROXY_PORT: -1 is not a TCP port: use 1-65535, or 0 for any free port."
    )
    path = write(tmp_path, "port = 70000\n")
    assert probe_run(["--config", path]) == (
        f"Error: {path}: port: 70000 is not a TCP port: use 1-65535, or 0 for any free port."
    )


# --- every validation message -----------------------------------------------------------------


def message_for(tmp_path: Path, text: str) -> str:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as caught:
        load_settings(config=path)
    return caught.value.message.replace(path, "FILE")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        pytest.param(
            "prot = 1\n",
            "FILE: prot: unknown key; did you mean 'port'?",
            id="unknown-top-level",
        ),
        pytest.param(
            "pause-cooldown = 1.0\n",
            "FILE: pause-cooldown: unknown key; did you mean 'pause_cooldown' "
            "(underscores, not dashes)?",
            id="dashes",
        ),
        pytest.param(
            "zzz = 1\n",
            "FILE: zzz: unknown key; known keys: ",
            id="unknown-far",
        ),
        pytest.param(
            'config = "other.toml"\n',
            "FILE: config: a config file cannot name another; remove this key.",
            id="config-in-config",
        ),
        pytest.param(
            'port = "8300"\n',
            "FILE: port: expected an integer, got a string '8300'; see `--port` in "
            "`thunderproxy serve --help`.",
            id="type-int",
        ),
        pytest.param(
            'profile = "yes"\n',
            "FILE: profile: expected true or false, got a string 'yes'; see `--profile` in "
            "`thunderproxy serve --help`.",
            id="type-bool",
        ),
        pytest.param(
            "pause_cooldown = true\n",
            "FILE: pause_cooldown: expected a number, got a boolean True; see "
            "`--pause-cooldown` in `thunderproxy serve --help`.",
            id="type-float",
        ),
        pytest.param(
            'router = "fast"\n',
            "FILE: router: 'fast' is not one of: default, tr.",
            id="choice",
        ),
        pytest.param(
            "target_fill = 1.5\n",
            "FILE: target_fill: 1.5 must be in (0, 1].",
            id="fraction",
        ),
        pytest.param(
            "max_wait = -1\n",
            "FILE: max_wait: -1.0 must be >= 0.",
            id="negative",
        ),
        pytest.param(
            "monitor_interval = 0\n",
            "FILE: monitor_interval: 0.0 must be > 0 seconds.",
            id="zero-interval",
        ),
        pytest.param(
            "backends = 3\n",
            "FILE: backends: expected [[backends]] tables, got an integer; write one "
            '[[backends]] table per backend, with url = "http://host:port".',
            id="backends-type",
        ),
        pytest.param(
            '[[backends]]\nurl = "http://a:1"\n[[backends]]\nmodels = ["m"]\n',
            "FILE: backends[1].url: missing; every [[backends]] table needs url = "
            '"http://host:port".',
            id="backend-url-missing",
        ),
        pytest.param(
            '[[backends]]\nurl = "a:1"\n',
            "FILE: backends[0].url: 'a:1' is not an http(s) URL; write it like "
            'url = "http://127.0.0.1:8000".',
            id="backend-url-scheme",
        ),
        pytest.param(
            '[[backends]]\nurl = "http://a:1"\nmodel = ["m"]\n',
            "FILE: backends[0].model: unknown key; did you mean 'models'?",
            id="backend-unknown-key",
        ),
        pytest.param(
            '[[backends]]\nurl = "http://a:1"\nmodels = []\n',
            "FILE: backends[0].models: expected a non-empty array of strings, got an empty "
            "array; list the served model names, or leave models out to read them from the "
            "backend's /v1/models.",
            id="backend-models-empty",
        ),
        pytest.param(
            '[[backends]]\nurl = "http://a:1"\nmodels = ["m", 3]\n',
            "FILE: backends[0].models[1]: expected a non-empty string, got an integer; list "
            "the served model names, or leave models out to read them from the backend's "
            "/v1/models.",
            id="backend-model-type",
        ),
        pytest.param(
            '[[backends]]\nurl = "http://a:1"\nmodels = ["m", "m"]\n',
            "FILE: backends[0].models[1]: 'm' is listed twice; list each name once.",
            id="backend-model-twice",
        ),
        pytest.param(
            '[[backends]]\nurl = "http://a:1"\n[[backends]]\nurl = "http://a:1/"\n',
            "FILE: backends[1].url: 'http://a:1' is already backends[0]; list each backend once.",
            id="backend-twice",
        ),
        pytest.param(
            '[[backends]]\nurl = "http://a:1"\nname = "g"\n'
            '[[backends]]\nurl = "http://b:1"\nname = "g"\n',
            "FILE: backends[1].name: 'g' is already the name of backends[0]; give each "
            "backend its own name.",
            id="backend-name-twice",
        ),
        pytest.param(
            '[[backends]]\nurl = "http://a:1"\nname = ""\n',
            "FILE: backends[0].name: expected a non-empty string, got ''; write "
            'name = "gpu0", or leave it out.',
            id="backend-name-empty",
        ),
        pytest.param(
            'aliases = ["coder"]\n',
            "FILE: aliases: expected a table, got an array; write [aliases] with lines like "
            'coder = ["qwen-32b"].',
            id="aliases-type",
        ),
        pytest.param(
            "[aliases]\ncoder = 3\n",
            "FILE: aliases.coder: expected a non-empty array of strings, got an integer; write "
            'coder = ["served-model-name", ...]: the first is the target, the rest fallbacks; '
            'or coder = "served-model-name".',
            id="alias-not-a-list",
        ),
        pytest.param(
            '[aliases]\ncoder = [""]\n',
            "FILE: aliases.coder[0]: expected a non-empty string, got ''; write "
            'coder = ["served-model-name", ...]: the first is the target, the rest fallbacks; '
            'or coder = "served-model-name".',
            id="alias-empty-name",
        ),
        pytest.param(
            '[[backends]]\nurl = "http://a:1"\nmodels = ["qwen-32b"]\n'
            '[aliases]\ncoder = ["qwen-32b", "qwen-8b"]\n',
            "FILE: aliases.coder[1]: 'qwen-8b' is served by no backend (served: qwen-32b); "
            "add it to a [[backends]] models list or correct the name.",
            id="alias-not-served",
        ),
        pytest.param(
            "port = \n",
            "FILE: invalid TOML: Invalid value (at line 1, column 8); fix that line "
            "(docs/CONFIG.md shows the format).",
            id="invalid-toml",
        ),
    ],
)
def test_every_config_file_error_names_the_key_and_the_remedy(
    tmp_path: Path, text: str, message: str
) -> None:
    assert message_for(tmp_path, text).startswith(message)


def test_alias_targets_are_not_checked_while_models_are_discovered(tmp_path: Path) -> None:
    text = '[[backends]]\nurl = "http://a:1"\n[aliases]\ncoder = ["anything"]\n'
    assert load_settings(config=write(tmp_path, text)).aliases["coder"] == ("anything",)


def test_an_alias_may_be_one_name_and_a_pattern(tmp_path: Path) -> None:
    """LiteLLM's users write ``"claude-*" = "qwen3-coder"``: a string target, a wildcard key."""
    text = (
        '[[backends]]\nurl = "http://a:1"\nmodels = ["qwen3-coder"]\n'
        '[aliases]\n"claude-*" = "qwen3-coder"\ncoder = ["qwen3-coder"]\n'
        'default_model = "qwen3-coder"\n'
    )
    settings = load_settings(
        config=write(tmp_path, text.replace('default_model = "qwen3-coder"\n', ""))
    )
    assert dict(settings.aliases) == {"claude-*": ("qwen3-coder",), "coder": ("qwen3-coder",)}
    top = 'default_model = "qwen3-coder"\n' + text.replace('default_model = "qwen3-coder"\n', "")
    assert load_settings(config=write(tmp_path, top)).default_model == "qwen3-coder"
    assert load_settings(default_model="none").default_model == "none"


def test_a_default_model_no_backend_serves_is_refused(tmp_path: Path) -> None:
    text = 'default_model = "qwen-8b"\n[[backends]]\nurl = "http://a:1"\nmodels = ["qwen-32b"]\n'
    assert message_for(tmp_path, text) == (
        "FILE: default_model: 'qwen-8b' is served by no backend (served: "
        "qwen-32b); name a served model, or add it to a [[backends]] models list."
    )


def test_a_missing_or_unreadable_config_file(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.toml")
    with pytest.raises(ConfigError) as caught:
        load_settings(config=missing)
    assert caught.value.message == (
        f"--config {missing!r}: no such file; pass the path of a TOML file "
        "(docs/CONFIG.md has an example)."
    )
    with pytest.raises(ConfigError) as caught:
        load_settings(config=str(tmp_path))
    assert caught.value.message == (
        f"--config {str(tmp_path)!r} is a directory; pass the path of a TOML file."
    )


def test_unknown_settings_from_code_and_bad_backend_flags() -> None:
    with pytest.raises(ConfigError) as caught:
        load_settings(prot=1)
    assert caught.value.message.startswith(
        "Unknown setting 'prot' (`thunderproxy serve --help` lists them); did you mean 'port'?"
    )
    with pytest.raises(ConfigError) as caught:
        load_settings(backends="gpu0:8000")
    assert caught.value.message == (
        "--backends: backend 'gpu0:8000' is not an http(s) URL; pass e.g. "
        "--backends http://127.0.0.1:8000"
    )
    with pytest.raises(ConfigError) as caught:
        load_settings(metrics_interval=0.0)
    assert caught.value.message == "--metrics-interval: 0.0 must be > 0 seconds."


# --- the embedded simulator's settings ------------------------------------------------------


@click.command()
@settings_options()
@click.pass_context
def sim_probe(ctx: click.Context, /, **values: Any) -> None:
    given, origins = given_values(ctx, values)
    try:
        settings = load_settings(given, origins=origins)
    except ConfigError as exc:
        raise click.ClickException(exc.message) from None
    click.echo(" ".join(f"{k}={v}" for k, v in sorted(settings.sim.items())))


def sim_run(args: list[str], env: dict[str, str] | None = None) -> str:
    isolated: dict[str, str | None] = {s.envvar: None for s in SETTINGS}
    isolated.update({k: None for k in os.environ if k.startswith("THUNDERPROXY_SIM_")})
    isolated.update(env or {})
    result = CliRunner().invoke(sim_probe, args, env=isolated, catch_exceptions=False)
    return result.output.strip()


def test_sim_settings_from_flags_variables_and_the_file_one_setting_at_a_time(
    tmp_path: Path,
) -> None:
    path = write(tmp_path, "[sim]\nmax_model_len = 200000\ntime_scale = 0.5\n")
    assert sim_run([]) == ""
    assert sim_run(["--config", path]) == "max_model_len=200000 time_scale=0.5"
    env = {"THUNDERPROXY_SIM_TIME_SCALE": "0.25", "THUNDERPROXY_SIM_PORT": "9000"}
    # The variables of `thunderproxy sim` (its own PORT is not a simulator setting).
    assert sim_run([], env) == "time_scale=0.25"
    assert sim_run(["--config", path], env) == "max_model_len=200000 time_scale=0.25"
    flags = ["--config", path, "--sim", "time-scale=2", "--sim", "enable_prefix_caching=off"]
    assert sim_run(flags, env) == "enable_prefix_caching=False max_model_len=200000 time_scale=2.0"


def test_sim_settings_errors_name_the_setting_and_what_it_takes(tmp_path: Path) -> None:
    assert sim_run(["--sim", "max_model_len=lots"]) == (
        "Error: --sim: max_model_len takes an integer, got 'lots'."
    )
    assert sim_run(["--sim", "max_modl_len=5"]) == (
        "Error: --sim: 'max_modl_len' is not a `thunderproxy sim` setting; did you mean "
        "'max_model_len'?"
    )
    assert sim_run(["--sim", "time_scale"]) == (
        "Error: --sim 'time_scale': expected NAME=VALUE, e.g. --sim max_model_len=262144."
    )
    assert sim_run(["--sim", "time_scale=0"]) == "Error: --sim: time_scale must be > 0, got 0.0."
    path = write(tmp_path, '[sim]\nmax_model_len = "big"\n')
    assert sim_run(["--config", path]) == (
        f"Error: {path}: sim: max_model_len takes an integer, got 'big'."
    )
    assert sim_run(["--sim", "time_scale=2", "--backends", "http://a:1"]) == (
        "Error: --sim (or a [sim] table) sets the simulator that serve starts when no "
        "--backends are given; remove it, or the backends."
    )
    # Variables left in the shell for a `thunderproxy sim` that --backends points at are no error.
    env = {"THUNDERPROXY_SIM_TIME_SCALE": "2"}
    assert sim_run(["--backends", "http://a:1"], env) == ""


def test_the_embedded_simulator_fits_a_long_agent_context() -> None:
    from thunderproxy.sim import SimConfig
    from thunderproxy.sim.config import EMBEDDED

    config = SimConfig(**EMBEDDED)
    assert config.max_model_len >= 131_072
    kv = config.resolved_num_gpu_blocks() * config.resolved_block_size()
    assert kv >= config.max_model_len
    assert config.cache_report()


def test_serve_help_lists_the_common_options_first_then_every_setting_in_one_section() -> None:
    from thunderproxy.config import HELP_SECTIONS

    named = [name for _, names in HELP_SECTIONS for name in names]
    assert len(named) == len(set(named))
    assert set(named) == set(SETTINGS_BY_NAME)
    text = CliRunner().invoke(cli, ["serve", "--help"], terminal_width=100).output
    titles = [line[:-1] for line in text.splitlines() if line.endswith(":") and line[0] != " "]
    assert titles == [title for title, _ in HELP_SECTIONS] + ["Other options"]
    common = text.split("Common options:", 1)[1].split("\n\n", 1)[0]
    assert "--backends" in common
    assert "--sim NAME=VALUE" in common
    assert "--council-models" not in common


async def test_secrets_in_any_url_setting_are_not_stored_in_runs_settings(tmp_path: Path) -> None:
    # A search API's key in --council-search-url's query was stored in runs.settings, which
    # Datasette shows to whoever reads the audit log.
    url = "https://user:pw@search.example/api?key=TOPSECRET&q=x"
    public = load_settings(council_search_url=url).public()
    assert public["council_search_url"] == "https://search.example/api?key=<redacted>&q=<redacted>"
    db = tmp_path / "audit.db"
    # Nothing listens on port 9: serve at once rather than wait ready_timeout for it.
    async with running_proxy(
        db, backends="http://127.0.0.1:9", council_search_url=url, ready_timeout=0
    ):
        pass
    (row,) = query(db, "SELECT settings FROM runs")
    assert "TOPSECRET" not in row["settings"]
    assert "pw@" not in row["settings"]
    assert "search.example/api?key=" in row["settings"]
