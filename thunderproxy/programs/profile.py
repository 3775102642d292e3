"""Per-program timing profiles (``GET /profiles``), kept as running sums in memory.

The audit log's ``steps`` table holds every step; this is the cheap live summary of it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

#: Profiles of released programs are kept until this many programs have been seen since.
MAX_PROFILES = 10_000


@dataclass
class Profile:
    step_count: int = 0
    prefill_s: float = 0.0
    prefill_n: int = 0
    decode_s: float = 0.0
    decode_n: int = 0
    pause_s: float = 0.0
    tool_s: float = 0.0
    tool_n: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0

    def as_dict(self) -> dict[str, Any]:
        def avg(total: float, n: int) -> float:
            return round(total / n, 6) if n else 0.0

        return {
            "step_count": self.step_count,
            "avg_prefill_s": avg(self.prefill_s, self.prefill_n),
            "avg_decode_s": avg(self.decode_s, self.decode_n),
            "avg_pause_s": avg(self.pause_s, self.step_count),
            "avg_tool_call_s": avg(self.tool_s, self.tool_n),
            "avg_kv_hit_rate": round(self.cached_tokens / self.prompt_tokens, 6)
            if self.prompt_tokens
            else 0.0,
        }


class Profiles:
    def __init__(self) -> None:
        self._by_program: OrderedDict[str, Profile] = OrderedDict()

    def get(self, program_id: str) -> Profile | None:
        return self._by_program.get(program_id)

    def items(self) -> list[tuple[str, Profile]]:
        return list(self._by_program.items())

    def add_step(
        self,
        program_id: str,
        *,
        prefill_s: float | None,
        decode_s: float | None,
        pause_s: float,
        tool_s: float | None,
        prompt_tokens: int | None,
        cached_tokens: int | None,
    ) -> None:
        profile = self._by_program.get(program_id)
        if profile is None:
            profile = self._by_program[program_id] = Profile()
            while len(self._by_program) > MAX_PROFILES:
                self._by_program.popitem(last=False)
        else:
            self._by_program.move_to_end(program_id)
        profile.step_count += 1
        profile.pause_s += pause_s
        if prefill_s is not None:
            profile.prefill_s += prefill_s
            profile.prefill_n += 1
        if decode_s is not None:
            profile.decode_s += decode_s
            profile.decode_n += 1
        if tool_s is not None:
            profile.tool_s += tool_s
            profile.tool_n += 1
        # Hit rate only over steps whose backend reported cached tokens, so it is not diluted
        # by backends that do not report them at all.
        if prompt_tokens is not None and cached_tokens is not None:
            profile.prompt_tokens += prompt_tokens
            profile.cached_tokens += cached_tokens
