"""Agent frameworks as their users run them, unmodified, through a real proxy in front of the
simulator: each task must be one program, and every step must say how it was tied to it.

Behind the ``clients`` marker (``pytest -m clients``): it installs the clients itself, the
Python ones (mini-swe-agent, the openai-agents SDK, LiteLLM) into a virtualenv of their own,
aider into another and Codex from npm, all under pytest's temporary folder, and skips,
saying why, where it cannot. Each task runs in a process of its own, the tasks of one
framework at the same time, so the proxy sees their calls interleaved. Claude Code has its own
marker (``test_claude_code.py``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio

from thunderproxy.runtime import RunningProxy
from thunderproxy.sim import SimConfig, open_simulator

from ..conftest import apt_install, query, running_proxy
from ..sim.test_sim_http import MODEL

pytestmark = pytest.mark.clients

HERE = Path(__file__).resolve().parent / "clients"
PYTHON_CLIENTS = ("mini-swe-agent", "openai-agents", "litellm")
TASKS = ("Find the failing test.", "Count the Python files.", "Rename the module.")
#: Replies with and without tool calls, so each framework's handling of both is exercised.
TOOLS_HALF_THE_TIME = {"tool_call_probability": 0.5, "tool_call_after_result_probability": 0.5}


def run(argv: list[str], timeout: float, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv, capture_output=True, text=True, timeout=timeout, check=False, **kwargs
    )


@pytest.fixture(scope="session")
def client_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A virtualenv with the Python clients, apart from the proxy's own environment."""
    venv = tmp_path_factory.mktemp("clients") / "venv"
    done = run([sys.executable, "-m", "venv", str(venv)], timeout=120)
    if done.returncode != 0:
        pytest.skip(f"could not make a virtualenv for the clients: {done.stderr[-500:]}")
    python = venv / "bin" / "python"
    done = run([str(python), "-m", "pip", "install", "--quiet", *PYTHON_CLIENTS], timeout=900)
    if done.returncode != 0:
        pytest.skip(f"pip could not install {', '.join(PYTHON_CLIENTS)}: {done.stderr[-500:]}")
    return python


@pytest.fixture(scope="session")
def codex(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``codex`` from the npm package @openai/codex (npm from apt-get when missing)."""
    if shutil.which("npm") is None and not apt_install("npm"):
        pytest.skip("npm is missing and apt-get could not install it")
    prefix = tmp_path_factory.mktemp("codex")
    done = run(["npm", "install", "--prefix", str(prefix), "@openai/codex"], timeout=900)
    binary = prefix / "node_modules" / ".bin" / "codex"
    if done.returncode != 0 or not binary.exists():
        pytest.skip(f"npm could not install @openai/codex: {done.stderr[-500:]}")
    return binary


#: aider, in a virtualenv of its own: it pins its dependencies (LiteLLM among them) apart from
#: the other Python clients'.
AIDER = "aider-chat>=0.86,<0.87"


@pytest.fixture(scope="session")
def aider(tmp_path_factory: pytest.TempPathFactory) -> Path:
    venv = tmp_path_factory.mktemp("aider") / "venv"
    done = run([sys.executable, "-m", "venv", str(venv)], timeout=120)
    if done.returncode != 0:
        pytest.skip(f"could not make a virtualenv for aider: {done.stderr[-500:]}")
    done = run(
        [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", AIDER], timeout=900
    )
    binary = venv / "bin" / "aider"
    if done.returncode != 0 or not binary.exists():
        pytest.skip(f"pip could not install {AIDER}: {done.stderr[-500:]}")
    return binary


def client_env(home: Path) -> dict[str, str]:
    """A home of its own (no settings or credentials of the machine's user, nothing written
    outside the test's folder) and no network beyond loopback."""
    home.mkdir(parents=True, exist_ok=True)
    return {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "XDG_CONFIG_HOME": str(home / ".config"),
        "XDG_CACHE_HOME": str(home / ".cache"),
        "MSWEA_SILENT_STARTUP": "1",
        "MSWEA_GLOBAL_CONFIG_DIR": str(home / "mini-swe-agent"),
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
        "HF_HUB_OFFLINE": "1",
        "OPENAI_API_KEY": "unused",
        "NO_PROXY": "127.0.0.1,localhost",
    }


@asynccontextmanager
async def proxy_on_sim(tmp_path: Path, **sim: Any) -> AsyncIterator[RunningProxy]:
    config = SimConfig(time_scale=0.01, max_model_len=65_536, kv_capacity_tokens=400_000, **sim)
    async with (
        open_simulator(config) as simulator,
        running_proxy(tmp_path / "audit.db", backends=simulator.url, shutdown_grace=1.0) as proxy,
    ):
        yield proxy


async def run_tasks(argvs: list[list[str]], env: list[dict[str, str]], cwd: Path) -> list[str]:
    """Each argv at the same time; their standard outputs, in order."""
    outputs = [""] * len(argvs)

    async def one(i: int) -> None:
        done = await trio.run_process(
            argvs[i], env=env[i], cwd=cwd, capture_stdout=True, capture_stderr=True, check=False
        )
        out, err = done.stdout.decode(errors="replace"), done.stderr.decode(errors="replace")
        assert done.returncode == 0, (argvs[i], out[-2000:], err[-2000:])
        outputs[i] = out

    with trio.fail_after(300):
        async with trio.open_nursery() as nursery:
            for i in range(len(argvs)):
                nursery.start_soon(one, i)
    return outputs


def assert_one_program_per_task(db: Path, tasks: int, first: str, *, calls: int) -> None:
    """``tasks`` programs of ``calls`` steps in all, each numbered 1.. in order, every step with
    its source: the first ``first``, the later ones recognised, not new."""
    rows = query(db, "SELECT program_id, step, status, source FROM steps ORDER BY id")
    assert len(rows) == calls, rows
    assert all(r["status"] == 200 for r in rows), rows
    programs: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        programs.setdefault(row["program_id"], []).append(row)
    assert len(programs) == tasks, {p: len(s) for p, s in programs.items()}
    for steps in programs.values():
        assert [s["step"] for s in steps] == list(range(1, len(steps) + 1)), steps
        assert steps[0]["source"] == first, steps
        assert all(s["source"] not in (None, "new", "default") for s in steps[1:]), steps


async def test_mini_swe_agent_tasks_are_one_program_each(
    tmp_path: Path, client_python: Path
) -> None:
    """Half the replies come without a tool call: mini-swe-agent drops them and says so."""
    script = str(HERE / "mini_swe_agent_task.py")
    async with proxy_on_sim(tmp_path, **TOOLS_HALF_THE_TIME) as proxy:
        argvs = [[str(client_python), script, proxy.url + "/v1", MODEL, t, "5"] for t in TASKS]
        envs = [client_env(tmp_path / f"home{i}") for i in range(len(TASKS))]
        outputs = await run_tasks(argvs, envs, tmp_path)
    calls = sum(int(out.split()[-1]) for out in outputs)
    assert_one_program_per_task(tmp_path / "audit.db", len(TASKS), "new", calls=calls)
    dropped = query(tmp_path / "audit.db", "SELECT count(*) AS n FROM steps WHERE source = ?",
                    "prompt_prefix")  # fmt: skip
    assert dropped[0]["n"] > 0  # the sim's fixed random seed gives replies without a tool call


@pytest.mark.parametrize("api", ["chat", "responses"])
async def test_openai_agents_sdk_tasks_are_one_program_each(
    tmp_path: Path, client_python: Path, api: str
) -> None:
    script = str(HERE / "openai_agents_task.py")
    async with proxy_on_sim(tmp_path, **TOOLS_HALF_THE_TIME) as proxy:
        argvs = [[str(client_python), script, proxy.url + "/v1", MODEL, t, "4", api] for t in TASKS]
        envs = [client_env(tmp_path / f"home{i}") for i in range(len(TASKS))]
        outputs = await run_tasks(argvs, envs, tmp_path)
    # A run ends at its turn limit or at the first answer without a tool call.
    calls = sum(int(out.split()[-1]) for out in outputs)
    assert_one_program_per_task(tmp_path / "audit.db", len(TASKS), "new", calls=calls)


async def test_litellm_loops_are_one_program_each(tmp_path: Path, client_python: Path) -> None:
    script = str(HERE / "litellm_task.py")
    async with proxy_on_sim(tmp_path, **TOOLS_HALF_THE_TIME) as proxy:
        argvs = [[str(client_python), script, proxy.url + "/v1", MODEL, t, "4"] for t in TASKS]
        envs = [client_env(tmp_path / f"home{i}") for i in range(len(TASKS))]
        await run_tasks(argvs, envs, tmp_path)
    assert_one_program_per_task(tmp_path / "audit.db", len(TASKS), "new", calls=4 * len(TASKS))


async def test_codex_sessions_are_one_program_each(tmp_path: Path, codex: Path) -> None:
    """``codex exec`` then ``codex exec resume --last`` twice: three calls of one session."""
    async with proxy_on_sim(tmp_path, tool_call_probability=0.0) as proxy:
        provider = [
            "-c", "model_provider=tp",
            "-c", 'model_providers.tp.name="thunderproxy"',
            "-c", f'model_providers.tp.base_url="{proxy.url}/v1"',
            "-c", 'model_providers.tp.wire_api="responses"',
            "-c", 'model_providers.tp.env_key="OPENAI_API_KEY"',
        ]  # fmt: skip
        # No -m: Codex asks for its own default model, which the proxy sends to the one the
        # simulator serves, as the README's line runs it.
        envs = []
        for i in range(len(TASKS)):
            env = client_env(tmp_path / f"home{i}")
            env["CODEX_HOME"] = env["HOME"]
            envs.append(env)
        first = [
            [str(codex), "exec", "--skip-git-repo-check", "-s", "read-only", *provider, t]
            for t in TASKS
        ]
        await run_tasks(first, envs, tmp_path)
        for _ in range(2):
            more = [
                [str(codex), "exec", "--skip-git-repo-check", *provider, "resume", "--last",
                 "Go on."]
                for _ in TASKS
            ]  # fmt: skip
            await run_tasks(more, envs, tmp_path)
    assert_one_program_per_task(tmp_path / "audit.db", len(TASKS), "codex", calls=3 * len(TASKS))


async def test_an_aider_chat_is_one_program(tmp_path: Path, aider: Path) -> None:
    """aider's line from the README, with two questions on its input: it appends a reminder to
    its newest message and drops it on the next turn, and moves its files pair behind the
    answer; both turns are one program (were two), its model name sent to the served one."""
    async with proxy_on_sim(tmp_path, tool_call_probability=0.0) as proxy:
        argv = [
            str(aider), "--model", "openai/any", "--openai-api-base", proxy.url + "/v1",
            "--openai-api-key", "unused",
            # Not a terminal: no git, no questions, plain input and output.
            "--no-git", "--yes-always", "--no-fancy-input", "--no-pretty", "--no-stream",
            "--no-show-model-warnings", "--no-check-update", "--analytics-disable",
        ]  # fmt: skip
        work = tmp_path / "work"
        work.mkdir()
        with trio.fail_after(300):
            done = await trio.run_process(
                argv,
                stdin=b"Add a docstring to main.py.\nNow add a test for it.\n",
                env=client_env(tmp_path / "home"),
                cwd=work,
                capture_stdout=True,
                capture_stderr=True,
                check=False,
            )
        output = done.stdout.decode(errors="replace") + done.stderr.decode(errors="replace")
        assert done.returncode == 0, output[-2000:]
    rows = query(tmp_path / "audit.db", "SELECT model, served_model FROM steps")
    assert rows == [{"model": "any", "served_model": MODEL}] * 2, rows
    assert_one_program_per_task(tmp_path / "audit.db", 1, "new", calls=2)
    sources = query(tmp_path / "audit.db", "SELECT source FROM steps ORDER BY id")
    assert [s["source"] for s in sources] == ["new", "edited_prefix"]
