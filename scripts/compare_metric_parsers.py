"""Could prometheus_client's parser replace backends/metrics.py's own? Correctness and speed.

Runs both parsers over the simulator's /metrics text for every vLLM compat level and SGLang
(the shapes the poller reads), checks that they find the same samples, tries a few malformed
inputs a backend might send, and times both. Usage::

    python scripts/compare_metric_parsers.py [--repeat 300]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time

from prometheus_client.parser import text_string_to_metric_families

from thunderproxy.backends.metrics import parse_prometheus
from thunderproxy.sim import Engine, SimConfig
from thunderproxy.sim.api.exposition import render
from thunderproxy.sim.config import COMPAT_VERSIONS

Key = tuple[str, tuple[tuple[str, str], ...], float]


def _value(value: float) -> float:
    return -1.0 if math.isnan(value) else value  # NaN != NaN; compare it as a marker


def hand_samples(text: str) -> set[Key]:
    return {
        (s.name, tuple(sorted(s.labels.items())), _value(s.value))
        for samples in parse_prometheus(text).values()
        for s in samples
    }


def library_samples(text: str) -> set[Key]:
    return {
        (s.name, tuple(sorted(s.labels.items())), _value(s.value))
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def library_dict(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """What a drop-in replacement would have to build: samples grouped by sample name."""
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def timed(text: str, repeat: int) -> tuple[list[float], list[float]]:
    """Microseconds per parse for each parser, taken in alternation so that load from other
    processes falls on both alike."""
    hand: list[float] = []
    lib: list[float] = []
    for _ in range(repeat):
        for parse, runs in ((parse_prometheus, hand), (library_dict, lib)):
            start = time.perf_counter()
            parse(text)
            runs.append((time.perf_counter() - start) * 1e6)
    return hand, lib


MALFORMED = {
    "unclosed label set": 'vllm:num_requests_running{engine="0" 3\n',
    "value not a number": "vllm:num_requests_running abc\n",
    "stray text line": "this is not a metric line\n",
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=300)
    args = parser.parse_args()
    shapes = [(compat, "vllm") for compat in COMPAT_VERSIONS] + [("current", "sglang")]
    header = f"{'shape':<16}{'bytes':>7}{'samples':>9}{'same':>6}"
    print(header + "   hand us (min/median)   library us (min/median)   ratio of medians")
    all_same = True
    for compat, personality in shapes:
        text = render(Engine(SimConfig(compat=compat, personality=personality)))
        hand, lib = hand_samples(text), library_samples(text)
        same = hand == lib
        all_same &= same
        hand_us, lib_us = timed(text, args.repeat)
        h_min, h_med = min(hand_us), statistics.median(hand_us)
        l_min, l_med = min(lib_us), statistics.median(lib_us)
        name = f"{personality} {compat}"
        print(
            f"{name:<16}{len(text):>7}{len(hand):>9}{'yes' if same else 'NO':>6}"
            f"{h_min:>11.0f}/{h_med:<11.0f}{l_min:>14.0f}/{l_med:<14.0f}{l_med / h_med:>8.1f}"
        )
        if not same:
            print("  only hand:", sorted(hand - lib)[:5])
            print("  only lib: ", sorted(lib - hand)[:5])
    print()
    good = render(Engine(SimConfig()))
    for what, line in MALFORMED.items():
        text = good + line
        try:
            kept = len(library_samples(text))
            verdict = f"kept {kept} samples"
        except ValueError as exc:
            verdict = f"raised ValueError ({str(exc)[:40]}...): the whole poll is lost"
        print(f"{what}: hand kept {len(hand_samples(text))} samples; library {verdict}")
    return 0 if all_same else 1


if __name__ == "__main__":
    sys.exit(main())
