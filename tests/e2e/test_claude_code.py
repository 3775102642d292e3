"""Claude Code itself (the npm package, unmodified) against a plain ``serve``: no backends, so
the proxy's embedded simulator with its defaults, and nothing set but where to listen and write.
``claude -p`` must finish, and its calls must be one program, with its steps in the audit db and
the prefix cache's hits recorded on every step after the first. Behind the ``claude_code`` marker
(``pytest -m claude_code``): it installs Node packages and runs a large client.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import trio

from ..conftest import apt_install, query, running_proxy
from ..sim.test_sim_http import MODEL

# Both markers: `pytest -m claude_code` runs it alone, `pytest -m clients` with the other clients.
pytestmark = [pytest.mark.claude_code, pytest.mark.clients]

PACKAGE = "@anthropic-ai/claude-code"


def run(argv: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)


@pytest.fixture(scope="session")
def claude(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``claude`` from the npm package, installed into pytest's temporary folder (npm from
    apt-get when missing). Skips, saying why, if it cannot be installed."""
    if shutil.which("npm") is None and not apt_install("npm"):
        pytest.skip("npm is missing and apt-get could not install it")
    prefix = tmp_path_factory.mktemp("claude-code")
    done = run(["npm", "install", "--prefix", str(prefix), PACKAGE], timeout=600)
    binary = prefix / "node_modules" / ".bin" / "claude"
    if done.returncode != 0 or not binary.exists():
        pytest.skip(f"npm could not install {PACKAGE}: {done.stderr[-500:]}")
    return binary


async def test_claude_code_print_mode_is_one_program(tmp_path: Path, claude: Path) -> None:
    db = tmp_path / "audit.db"
    home = tmp_path / "home"
    home.mkdir()
    # Its system prompt and tool schemas alone are some 38,000 tokens: the embedded simulator's
    # context must take them as it is. Tool calls it draws are refused by -p (no one to ask for
    # permission), and Claude Code goes on with the refusal as the tool's result.
    async with running_proxy(db, shutdown_grace=1.0) as proxy:
        # As the README writes it: the base URL and a key, nothing else. No --model: Claude Code
        # asks for its own models (claude-opus-…, claude-haiku-… on its small background calls,
        # which carry tools: []), and the proxy sends them to the one model it serves.
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            # A home of its own: no settings, credentials or history of the machine's user.
            "HOME": str(home),
            "ANTHROPIC_BASE_URL": proxy.url,
            "ANTHROPIC_API_KEY": "unused",
        }
        # Two turns of one session: the second (--continue keeps the session's id) makes at
        # least one more call, whatever the simulator draws for the first.
        for turn in (["Say hello in one sentence."], ["--continue", "Say it once more."]):
            argv = [str(claude), "-p", *turn]
            with trio.fail_after(300):
                done = await trio.run_process(
                    argv,
                    env=env,
                    cwd=tmp_path,
                    capture_stdout=True,
                    capture_stderr=True,
                    check=False,
                )
            output = done.stdout.decode(errors="replace")
            errors = done.stderr.decode(errors="replace")
            assert done.returncode == 0, (output[-2000:], errors[-2000:])
            assert output.strip(), errors[-2000:]
    rows = query(
        db,
        "SELECT program_id, endpoint, model, served_model, status, prompt_tokens, cached_tokens "
        "FROM steps ORDER BY id",
    )
    print("steps (model asked, prompt tokens, cached tokens):",
          [(r["model"], r["prompt_tokens"], r["cached_tokens"]) for r in rows])  # fmt: skip
    # No 4xx, no failure: its model names and its empty tool lists are served. A background
    # call it gives up on once its answer is out ends as its client leaving (499).
    assert rows, rows
    assert all(r["status"] in (200, 499) for r in rows), rows
    assert all(r["model"].startswith("claude-") for r in rows), rows
    assert all(r["served_model"] == MODEL for r in rows), rows
    messages = [r for r in rows if r["endpoint"] == "/v1/messages" and r["status"] == 200]
    assert all((r["prompt_tokens"] or 0) > 0 for r in messages), messages
    # One session, one program; a subagent it starts (it may, as the simulator draws tool
    # calls) is a program of its own, named after the session.
    programs = {r["program_id"] for r in rows}
    sessions = {p for p in programs if "/" not in p}
    assert len(sessions) == 1, rows
    (program,) = sessions
    assert all(p.startswith(program + "/") for p in programs - sessions), programs
    sources = query(
        db, "SELECT source FROM transitions WHERE program_id = ? AND source IS NOT NULL", program
    )
    assert [s["source"] for s in sources] == ["claude_code"], (program, sources)
    assert program.startswith("claude-code:")
    # Each call of its agent loop resends the conversation (its system prompt and tools alone
    # are some 38,000 tokens): every one after the first reads its prefix from the cache,
    # reported in Anthropic's cache_read_input_tokens and recorded as cached tokens.
    loop = [r for r in messages if r["prompt_tokens"] > 30_000 and r["program_id"] == program]
    # The first finds at most a block or two that an earlier small call shared with it.
    assert loop[0]["cached_tokens"] < 1_000, loop
    later = loop[1:]
    assert later, loop
    assert all(r["cached_tokens"] > 30_000 for r in later), loop
    # Its probe of the root at start (HEAD /) is answered, not refused and recorded.
    assert query(db, "SELECT method, path, status FROM rejections") == []
