"""A backend behind nginx ``auth_basic`` (Debian's package), named with its credentials in the
URL, called through the proxy by clients that send keys of their own, as every SDK does: nginx
answers 400 to a request with two Authorization headers, so the proxy must send one, the
backend's. Installed with apt-get when missing; skipped, saying why, only if it cannot be."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest
import trio

from thunderproxy.sim import SimConfig, open_simulator

from ..conftest import apt_install, query, running_proxy
from ..sim.test_sim_http import MODEL
from .test_prometheus_scrape import free_port


def nginx_binary() -> str:
    found = shutil.which("nginx") or shutil.which("/usr/sbin/nginx")
    if found is None and apt_install("nginx-light", timeout_s=600):
        found = shutil.which("nginx") or shutil.which("/usr/sbin/nginx")
    if found is None:
        pytest.skip("nginx is not installed and apt-get could not install it (not root?)")
    return found


def nginx_config(folder: Path, port: int, upstream: str) -> Path:
    (folder / "htpasswd").write_text("user:{PLAIN}secret\n")
    config = folder / "nginx.conf"
    # Started as root, nginx's workers would run as nobody, who cannot read the test's folder.
    user = "user root root;" if os.geteuid() == 0 else ""
    config.write_text(
        f"""
{user}
daemon off;
pid {folder}/nginx.pid;
error_log {folder}/error.log;
events {{}}
http {{
    access_log off;
    client_body_temp_path {folder};
    proxy_temp_path {folder};
    server {{
        listen 127.0.0.1:{port};
        location / {{
            auth_basic "backend";
            auth_basic_user_file {folder}/htpasswd;
            proxy_pass {upstream};
            proxy_http_version 1.1;
            proxy_buffering off;
        }}
    }}
}}
"""
    )
    return config


async def test_a_backend_behind_nginx_auth_basic_answers_clients_sending_their_own_key(
    tmp_path: Path,
) -> None:
    binary = await trio.to_thread.run_sync(nginx_binary)
    port = free_port()
    async with open_simulator(SimConfig(time_scale=0.01)) as sim:
        config = nginx_config(tmp_path, port, sim.url)
        process = await trio.lowlevel.open_process(
            [binary, "-c", str(config), "-e", str(tmp_path / "error.log")],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            async with httpx.AsyncClient(timeout=10) as direct:
                with trio.fail_after(10):
                    while True:
                        try:
                            await direct.get(f"http://127.0.0.1:{port}/")
                            break
                        except httpx.TransportError:
                            await trio.sleep(0.05)
            backend = f"http://user:secret@127.0.0.1:{port}"
            db = tmp_path / "audit.db"
            async with (
                running_proxy(db, backends=backend) as proxy,
                httpx.AsyncClient(base_url=proxy.url, timeout=20) as client,
            ):
                key = {"authorization": "Bearer sk-what-any-sdk-sends"}
                body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
                for stream in (False, True):
                    answer = await client.post(
                        "/v1/chat/completions", json={**body, "stream": stream}, headers=key
                    )
                    assert answer.status_code == 200, answer.text
                message = {"model": MODEL, "max_tokens": 8, "messages": body["messages"]}
                answer = await client.post("/v1/messages", json=message, headers=key)
                assert answer.status_code == 200, answer.text
                models = await client.get("/v1/models", headers=key)
                assert models.status_code == 200, models.text
        finally:
            process.terminate()
            await process.wait()
    statuses = [row["status"] for row in query(db, "SELECT status FROM steps")]
    assert statuses == [200, 200, 200], statuses
