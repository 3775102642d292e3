"""Requests waiting for their paused program to be resumed."""

from __future__ import annotations

import trio


class Waiter:
    def __init__(self) -> None:
        self._event = trio.Event()
        self.error: Exception | None = None
        #: Woken because its call fits now (a held call's release), not to look again.
        self.granted = False

    @property
    def woken(self) -> bool:
        return self._event.is_set()

    async def wait(self) -> None:
        """Until woken; raises the error it was woken with (the program was released)."""
        await self._event.wait()
        if self.error is not None:
            raise self.error

    def wake(self, error: Exception | None) -> None:
        self.error = error
        self._event.set()


class Waiters:
    def __init__(self) -> None:
        self._by_program: dict[str, list[Waiter]] = {}

    def add(self, program_id: str) -> Waiter:
        waiter = Waiter()
        self._by_program.setdefault(program_id, []).append(waiter)
        return waiter

    def drop(self, program_id: str, waiter: Waiter) -> bool:
        """Forget ``waiter``; True when no request of the program waits any more."""
        waiters = self._by_program.get(program_id, [])
        if waiter in waiters:
            waiters.remove(waiter)
        if waiters:
            return False
        self._by_program.pop(program_id, None)
        return True

    def has(self, program_id: str) -> bool:
        return program_id in self._by_program

    def __bool__(self) -> bool:
        return bool(self._by_program)

    def wake_one(self, program_id: str) -> bool:
        """Wake the program's newest request as ``granted`` (a held call that fits now: the
        newest is the likeliest to find its context still cached, tr.on_call); False where
        none waits."""
        waiters = self._by_program.get(program_id)
        if not waiters:
            return False
        waiter = waiters.pop()
        waiter.granted = True
        waiter.wake(None)
        if not waiters:
            del self._by_program[program_id]
        return True

    def programs(self) -> list[str]:
        """The programs a request of which waits now."""
        return list(self._by_program)

    def wake(self, program_id: str, error: Exception | None = None) -> int:
        """Wake every request of the program (with ``error``, if any); how many there were."""
        waiters = self._by_program.pop(program_id, [])
        for waiter in waiters:
            waiter.wake(error)
        return len(waiters)
