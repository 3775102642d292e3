"""``serve --workers N``: N serve processes behind one port, sharing state through Redis.

(A serve process is a whole proxy; "worker" alone, in the code and the docs, means serverless
worker mode, ``worker/``. The flag and the supervisor's log lines keep the name ``--workers``
and "worker K" give the processes, as Hypercorn's and gunicorn's do.)

One Python process serves at most one core's worth of HTTP; past that, more processes. The
supervisor (this module, in the process ``serve`` started) holds the port with a socket bound
with SO_REUSEPORT that never listens, then forks N serve processes before any thread or event
loop exists. Each is a whole proxy (``runtime.run``) that binds the same port with SO_REUSEPORT
and listens: the kernel hashes every new connection to one of the listening sockets, so
connections spread evenly with no process in the data path. (The alternative, one listening
socket inherited by every process, lets whichever process wakes first take a connection, and a
busy one keeps taking them; docs/DEPLOY.md.)

What the processes share goes through ``--redis``, exactly as separate instances on separate
hosts would share it: the limits' global windows and each one's share (``admission/shared.py``),
the KV tokens each one's programs claim on every backend (tr subtracts the others' claims from
each backend's capacity) and which backend each program was placed on. Each process writes its
own audit db (``--db`` with ``.wK`` before the suffix), so no two processes write one SQLite file
or restore each other's programs.

The supervisor forwards SIGINT/SIGTERM/SIGHUP to the processes (each drains as a single proxy
does) and exits when all have. On Linux the processes die with it whatever ends it, SIGKILL
included: each asks the kernel for SIGTERM when its parent goes (``PR_SET_PDEATHSIG``), so it
drains and exits instead of serving the port on its own. A supervisor does not start while any
socket listens on its port: SO_REUSEPORT would let it bind beside them and share the traffic.

A process that dies after it served is started again; one that dies before it served (a
process that cannot start will not start the next time either) stops every process, and
``serve`` exits with an error.
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import logging
import os
import select
import signal
import socket
import sys
from functools import partial
from pathlib import Path

import trio

from . import __version__
from .config import Settings
from .errors import ConfigError, our_error
from .runtime import stop_signals

log = logging.getLogger("thunderproxy.scaleout")

#: How often the supervisor looks for processes that ended, while it has nothing else to do.
POLL_S = 0.2

#: prctl(2)'s option that sets the signal a process gets when its parent dies (linux/prctl.h).
PR_SET_PDEATHSIG = 1


def refuse_if_listened(host: str, port: int) -> None:
    """ConfigError if some socket already listens on ``host:port``.

    The supervisor binds with SO_REUSEPORT, which the kernel grants beside other SO_REUSEPORT
    listeners of the same user: the processes of an earlier supervisor that was killed, or of one
    still running, would then share the port with the new set, each set answering with its own
    settings. A bind without SO_REUSEPORT fails while any socket listens there."""
    if port == 0:
        return  # the kernel picks a port nobody holds
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                return  # bind_listener names any other problem with the port
            raise ConfigError(
                f"Port {port} on {host} is already in use by processes listening there (workers "
                "of an earlier `serve --workers` whose supervisor was killed keep serving it, "
                "and a new set would share its connections with them); stop them (`ss -ltnp "
                f"'sport = :{port}'` lists their pids) or pass --port with a free port."
            ) from None


def die_with_parent(parent: int) -> bool:
    """In a forked serve process: have the kernel send SIGTERM when the supervisor dies (Linux),
    so the process drains and exits rather than keep serving the port with no supervisor. False when
    the supervisor is already gone (it died before the request took effect)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
            log.warning(
                "worker %d: prctl(PR_SET_PDEATHSIG) failed (%s); it may outlive its supervisor",
                os.getpid(),
                os.strerror(ctypes.get_errno()),
            )
    return os.getppid() == parent


def process_db(db: str, k: int) -> str:
    """Serve process ``k``'s audit db: ``thunderproxy.db`` -> ``thunderproxy.w1.db`` (empty stays
    empty: no db)."""
    if not db:
        return db
    path = Path(db)
    return str(path.with_name(f"{path.stem}.w{k}{path.suffix}"))


def process_settings(settings: Settings, k: int, port: int) -> Settings:
    """What serve process ``k`` runs with: the port the supervisor holds, a db of its own."""
    return dataclasses.replace(settings, port=port, db=process_db(settings.db, k), workers=1)


def _serve_process(settings: Settings, ready: int) -> int:
    """The body of one forked serve process: a whole proxy on the shared port. Writes its pid and a
    newline to ``ready`` once it serves; returns its exit status."""
    from .runtime import run

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(partial(run, settings, handle_signals=True, reuse_port=True))
            os.write(ready, f"{os.getpid()}\n".encode())

    try:
        trio.run(main)
    except KeyboardInterrupt:
        return 0
    except BaseException as exc:  # noqa: BLE001 - a process reports and exits, never raises
        error = our_error(exc)
        if error is None:
            log.exception("worker %d stopped on an error", os.getpid())
        else:
            print(f"Error: {error.message}", file=sys.stderr)
        return 1
    return 0


class Supervisor:
    """Forks the serve processes, waits for them, restarts one that dies, stops them all on a
    signal."""

    def __init__(self, settings: Settings) -> None:
        from .runtime import bind_listener

        self.settings = settings
        refuse_if_listened(settings.host, settings.port)
        # Holds the port (and resolves --port 0) without listening: no connection comes here.
        self.holder = bind_listener(settings.host, settings.port, reuse_port=True, listen=False)
        self.port: int = self.holder.getsockname()[1]
        self.ready_read, self.ready_write = os.pipe()
        os.set_blocking(self.ready_read, False)
        #: pid -> process number, and the pids that said they serve.
        self.processes: dict[int, int] = {}
        self.serving: set[int] = set()
        self._said = b""
        self.stopping = False
        #: The signal that stopped the processes, logged once by the main loop.
        self.stopped_by: int | None = None
        self.said_stopping = False
        self.ready_logged = False
        self.failed = 0

    @property
    def url(self) -> str:
        host = f"[{self.settings.host}]" if ":" in self.settings.host else self.settings.host
        return f"{'https' if self.settings.certfile else 'http'}://{host}:{self.port}"

    def start(self, k: int) -> None:
        settings = process_settings(self.settings, k, self.port)
        supervisor = os.getpid()
        pid = os.fork()
        if pid == 0:  # the serve process
            code = 1
            try:
                for signum in stop_signals():
                    signal.signal(signum, signal.SIG_DFL)
                self.holder.close()
                os.close(self.ready_read)
                if die_with_parent(supervisor):
                    code = _serve_process(settings, self.ready_write)
            finally:
                logging.shutdown()
                sys.stderr.flush()
                os._exit(code)
        self.processes[pid] = k

    def on_signal(self, signum: int, frame: object) -> None:
        # A signal handler runs inside whatever the main thread was doing, a write to stderr
        # included: it must not log (a re-entrant write to the same stream raises, and the
        # processes would never be told). The main loop says it (``say_stopping``).
        if self.stopped_by is None:
            self.stopped_by = signum
        self.stopping = True
        for pid in self.processes:
            try:
                os.kill(pid, signum)  # a second signal stops them at once, as it does one proxy
            except ProcessLookupError:
                pass

    def say_stopping(self) -> None:
        if self.stopped_by is not None and not self.said_stopping:
            self.said_stopping = True
            log.info(
                "%s: stopping %d workers (each drains its requests first)",
                signal.Signals(self.stopped_by).name,
                len(self.processes),
            )

    def stop(self) -> None:
        self.on_signal(signal.SIGTERM, None)

    def reap(self) -> None:
        """Collect processes that ended; start again one that died while the others serve."""
        while self.processes:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                self.processes.clear()
                return
            if pid == 0:
                return
            k = self.processes.pop(pid, 0)
            served = pid in self.serving
            self.serving.discard(pid)
            code = os.waitstatus_to_exitcode(status)
            if self.stopping or k == 0:
                continue
            if not served:
                log.error(
                    "worker %d (pid %d) exited with %d before it served; stopping the others "
                    "(its error is above)",
                    k,
                    pid,
                    code,
                )
                self.failed = code or 1
                self.stop()
                continue
            log.warning("worker %d (pid %d) exited with %d; starting it again", k, pid, code)
            self.start(k)

    def read_ready(self) -> None:
        """Note the processes that said they serve (waits up to ``POLL_S`` for one to say so)."""
        readable, _, _ = select.select([self.ready_read], [], [], POLL_S)
        if not readable:
            return
        try:
            self._said += os.read(self.ready_read, 4096)
        except BlockingIOError:
            return
        *lines, self._said = self._said.split(b"\n")
        for line in lines:
            pid = int(line)
            if pid in self.processes:
                self.serving.add(pid)
                if self.ready_logged:
                    log.info("worker %d (pid %d) serves again", self.processes[pid], pid)

    def wait_ready(self) -> bool:
        """Until every process first serves (True), or one failed and all were stopped."""
        while len(self.serving) < self.settings.workers and not self.stopping:
            self.read_ready()
            self.reap()
        return not self.stopping

    def run(self) -> int:
        for signum in stop_signals():
            signal.signal(signum, self.on_signal)
        for k in range(1, self.settings.workers + 1):
            self.start(k)
        if self.wait_ready():
            log.info(
                "thunderproxy %s listening on %s (%d workers, pids %s, router=%s)",
                __version__,
                self.url,
                self.settings.workers,
                ",".join(str(pid) for pid in self.processes),
                self.settings.router,
            )
        self.ready_logged = True
        while self.processes:
            self.say_stopping()
            self.read_ready()
            self.reap()
        self.say_stopping()
        self.holder.close()
        return self.failed


def supervise(settings: Settings) -> int:
    """Run ``settings.workers`` proxies on one port until SIGINT/SIGTERM/SIGHUP; the exit
    status."""
    return Supervisor(settings).run()


__all__ = [
    "Supervisor",
    "die_with_parent",
    "refuse_if_listened",
    "supervise",
    "process_db",
    "process_settings",
]
