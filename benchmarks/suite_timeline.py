"""Where the test suite's wall time goes under its two xdist workers: busy, idle behind an exclusive test, and the
longest files, from the timeline the suite writes when ``DISTTRAIN_SUITE_TIMELINE`` is set (tests/scheduling.py).

    DISTTRAIN_SUITE_TIMELINE=/tmp/timeline.jsonl .venv/bin/python -m pytest
    python benchmarks/suite_timeline.py /tmp/timeline.jsonl

A worker that reaches an exclusive test waits until the other worker's current test (fixture setup included) has
ended; the other worker's next test then waits for the exclusive one. Both waits are idle cores: the report names
them with the test that was being waited for, as they are what a reordering or a shared launch would win back.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Protocol:
    worker: str
    test: str
    exclusive: bool
    asked: float
    started: float
    ended: float

    @property
    def waited(self) -> float:
        return self.started - self.asked

    @property
    def ran(self) -> float:
        return self.ended - self.started

    @property
    def file(self) -> str:
        return self.test.split("::", 1)[0]


def read_timeline(path: Path) -> list[Protocol]:
    protocols = [Protocol(**json.loads(line)) for line in path.read_text().splitlines() if line.strip()]
    return sorted(protocols, key=lambda p: p.asked)


def blocker(waiting: Protocol, protocols: list[Protocol]) -> Protocol | None:
    """The other worker's test that overlapped ``waiting``'s wait the longest: the one it waited for."""

    def overlap(p: Protocol) -> float:
        return min(p.ended, waiting.started) - max(p.started, waiting.asked)

    others = [p for p in protocols if p.worker != waiting.worker and overlap(p) > 0]
    return max(others, key=overlap, default=None)


def summarize(protocols: list[Protocol], top: int) -> str:
    start, end = min(p.asked for p in protocols), max(p.ended for p in protocols)
    lines = [f"suite wall {end - start:.0f} s, {len(protocols)} tests"]
    by_worker: dict[str, list[Protocol]] = defaultdict(list)
    for protocol in protocols:
        by_worker[protocol.worker].append(protocol)
    for worker, mine in sorted(by_worker.items()):
        busy, waited = sum(p.ran for p in mine), sum(p.waited for p in mine)
        last = max(p.ended for p in mine)
        lines.append(
            f"  {worker}: ran {busy:.0f} s, waited for the lock {waited:.0f} s, done {end - last:.0f} s before the end"
        )
    exclusive = [p for p in protocols if p.exclusive]
    lines.append(f"exclusive tests: {len(exclusive)}, ran {sum(p.ran for p in exclusive):.0f} s alone")
    waits = sorted((p for p in protocols if p.waited > 1.0), key=lambda p: -p.waited)
    lines.append(f"waits over 1 s: {len(waits)}, {sum(p.waited for p in waits):.0f} s in all; longest:")
    for protocol in waits[:top]:
        held_by = blocker(protocol, protocols)
        behind = f"behind {held_by.test} ({held_by.ran:.0f} s)" if held_by else "behind nothing found"
        kind = "exclusive" if protocol.exclusive else "shared"
        lines.append(f"  {protocol.waited:6.1f} s  {kind:9s} {protocol.test}  {behind}")
    files: dict[str, float] = defaultdict(float)
    for protocol in protocols:
        files[protocol.file] += protocol.ran
    lines.append("longest files (their tests' protocols, setup included):")
    for name, seconds in sorted(files.items(), key=lambda item: -item[1])[:top]:
        lines.append(f"  {seconds:6.1f} s  {name}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("timeline", type=Path)
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()
    print(summarize(read_timeline(args.timeline), args.top))


if __name__ == "__main__":
    main()
