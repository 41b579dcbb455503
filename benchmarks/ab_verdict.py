"""How well ``diagnose --ab --run`` resolves a change on this machine: an A/A test (or A/B of any override).

Runs the same interleaved rounds as ``python -m diagnose RUN --ab --run`` (diagnostics.ab.run_ab) on a command
of your choice: arm A is ``OVERRIDES``, arm B is ``OVERRIDES`` plus ``--b`` (nothing by default: an A/A test,
whose interval should contain zero and whose width is what this machine can resolve at that many rounds).
Prints each round, the per-arm median and spread, the change with its interval and the verdict.

    python benchmarks/ab_verdict.py [--repeats 3] [--max-repeats 10] [--b strategy.bucket_cap_mb=6] -- OVERRIDES
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from diagnostics.ab import run_ab, write_verdict
from diagnostics.ab.verdict import text_table
from diagnostics.recommend import AbTest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-repeats", type=int, default=10)
    parser.add_argument("--b", action="append", default=[], help="override(s) of arm B (none: an A/A test)")
    parser.add_argument("--out", type=Path, help="where the runs go (default: a temporary directory)")
    parser.add_argument("overrides", nargs="*", help="the python -m train overrides of both arms")
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="ab_verdict_"))
    label = " ".join(args.b) or "A/A (same config)"
    test = AbTest(label, (), "", tuple(args.overrides), (*args.overrides, *args.b), label)
    ab = run_ab(out, [test], args.repeats, args.max_repeats)
    verdict = write_verdict(ab, out)
    (rec,) = verdict["recommendations"]
    print(f"{ab.rounds} rounds in {ab.set_dir}")
    print(text_table(verdict))
    print(json.dumps({k: rec[k] for k in ("verdict", "change", "ci", "pairs", "resolved")}))


if __name__ == "__main__":
    main()
