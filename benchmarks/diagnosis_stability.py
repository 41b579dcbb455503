"""Does the same command give the same warnings? The set of warning/critical finding kinds over repeated runs.

Runs each command ``--repeats`` times (default 3), interleaved (A, B, C, A, B, C, ...) so drift on a shared
machine hits every command alike, and prints per command the warning/critical kinds of each run and whether they
agree, as kinds (issue 11: the same command run three times gives the same set) and with their ranks. The
commands: ``python -m train`` with its defaults (``--steps`` shortens it; 220 steps take ~100 s here) and
injected scenarios of ``benchmarks/diagnosis_accuracy.py`` (their faulty arm). A measurement: it exits 0 whatever
it finds.

    python benchmarks/diagnosis_stability.py [--repeats 3] [--steps 220] [--scenarios input-all-ddp ...]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.diagnosis_accuracy import LOUD, SCENARIOS, SHORT, RunResult, run_train

DEFAULT_SCENARIOS = ["input-all-ddp", "forward-rank1-ddp"]


def loud_kinds(result: RunResult) -> list[str]:
    """The sorted warning/critical findings of one run as ``kind[ranks]``."""
    return sorted(
        f"{f['kind']}[{','.join(str(r) for r in f.get('ranks', []))}]" for f in result.findings if f["severity"] in LOUD
    )


def agreement(runs: list[list[str] | None], with_ranks: bool = False) -> bool | None:
    """True when every successful run raised the same set of kinds (and ranks, ``with_ranks``); None when fewer
    than two runs succeeded."""
    sets = [frozenset(k if with_ranks else k.split("[")[0] for k in kinds) for kinds in runs if kinds is not None]
    return None if len(sets) < 2 else len(set(sets)) == 1


def yes_no(value: bool | None) -> str:
    return "n/a" if value is None else "yes" if value else "NO"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=220, help="trainer.max_steps of the default run (default 220)")
    parser.add_argument("--scenarios", nargs="*", default=DEFAULT_SCENARIOS, help="accuracy scenarios' faulty arms")
    parser.add_argument("--no-default", action="store_true", help="skip the python -m train defaults run")
    parser.add_argument("--json", type=Path, help="write the kinds per run here")
    parser.add_argument("--keep", type=Path, help="keep the run directories here (default: a temporary one)")
    args = parser.parse_args()
    by_name = {s.name: s for s in SCENARIOS}
    unknown = [n for n in args.scenarios if n not in by_name]
    if unknown:
        parser.error(f"--scenarios: unknown {', '.join(unknown)}; choose from {', '.join(by_name)}")
    # (name, base overrides, overrides): the default run takes the CLI defaults, only its length changes.
    commands = [] if args.no_default else [("default", [], [f"trainer.max_steps={args.steps}"])]
    commands += [(name, SHORT, by_name[name].fault) for name in args.scenarios]
    kinds: dict[str, list[list[str] | None]] = {name: [] for name, _, _ in commands}
    with tempfile.TemporaryDirectory() as tmp:
        root = args.keep or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        for i in range(args.repeats):
            for name, base, overrides in commands:
                start = time.monotonic()
                result = run_train(overrides, root / f"{name}-{i}", base=base)
                kinds[name].append(loud_kinds(result) if result.ok else None)
                shown = ", ".join(kinds[name][-1] or ["none"]) if result.ok else result.error
                print(f"  {name} #{i + 1}: {shown} ({time.monotonic() - start:.0f} s)", flush=True)
    print()
    stable = 0
    for name, runs in kinds.items():
        agree = agreement(runs)
        stable += bool(agree)
        print(f"{name}: kinds agree: {yes_no(agree)}; with their ranks: {yes_no(agreement(runs, with_ranks=True))}")
        for i, run in enumerate(runs):
            print(f"  #{i + 1}: " + ("failed" if run is None else (", ".join(run) or "none")))
    if args.json:
        args.json.write_text(json.dumps(kinds, indent=2) + "\n")
    print(f"stable: {stable} of {len(kinds)} commands give the same warning/critical kinds in every run")


if __name__ == "__main__":
    main()
