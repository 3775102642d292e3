"""The test process run out of file descriptors for real: its soft ``RLIMIT_NOFILE`` lowered
near what it holds, and the rest taken, so the next socket() or accept() fails with EMFILE."""

from __future__ import annotations

import errno
import os
import resource
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def exhausted_descriptors() -> Iterator[list[int]]:
    """While inside, no descriptor can be opened; yields the ones taken, so a test can give
    some back. The limit and the descriptors are restored on the way out."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    taken: list[int] = []
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 16, hard))
    try:
        while True:
            try:
                taken.append(os.open(os.devnull, os.O_RDONLY))
            except OSError as exc:
                if exc.errno != errno.EMFILE:
                    raise
                break
        yield taken
    finally:
        for fd in taken:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
