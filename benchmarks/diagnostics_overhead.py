"""What diagnostics cost: tokens/s of the same run with ``diagnostics=default`` vs ``diagnostics=off``.

Runs are interleaved (off, default, off, default, ...) so drift on a shared machine hits both sides; the
ratio of the medians is printed (target >= 0.98).

    python benchmarks/diagnostics_overhead.py [--steps 120] [--repeats 2] [--extra strategy=fsdp ...]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_cli import train_manifest


def tokens_per_s(diagnostics: str, steps: int, extra: list[str]) -> float:
    overrides = [
        f"diagnostics={diagnostics}",
        f"trainer.max_steps={steps}",
        f"trainer.val_every_n_steps={steps}",
        "trainer.val_batches=1",
        f"trainer.ckpt_every_n_steps={steps}",
        *extra,
    ]
    return train_manifest(overrides)["result"]["tokens_per_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--extra", nargs="*", default=[])
    args = parser.parse_args()
    results: dict[str, list[float]] = {"off": [], "default": []}
    for _ in range(args.repeats):
        for mode in ("off", "default"):
            results[mode].append(tokens_per_s(mode, args.steps, args.extra))
    off, on = statistics.median(results["off"]), statistics.median(results["default"])
    print(f"diagnostics=off     : {off:10,.0f} tokens/s  (runs: {', '.join(f'{v:,.0f}' for v in results['off'])})")
    print(f"diagnostics=default : {on:10,.0f} tokens/s  (runs: {', '.join(f'{v:,.0f}' for v in results['default'])})")
    print(f"ratio (target >= 0.98): {on / off:8.3f}")


if __name__ == "__main__":
    main()
