"""Does ``strategy=auto`` pick a layout within 5% of the fastest one measured on this machine?

Each repeat trains every candidate layout of ``plan_accuracy.py`` (ddp, fsdp, deepspeed-2, megatron tp2 and pp2,
one global batch for all) and then ``strategy=auto`` with ``calibration=`` the repeat's DDP run (its start-up
measurements: matmul rate, links, the model's own parts), in rotated order so that a drift in the host's load
does not favour one arm. Auto's run is measured like the others: its median step against the fastest layout's,
per repeat, and the median over repeats. Target (issue 30): auto's step within 5% of the fastest.

    python benchmarks/auto_ranking.py --repeats 2 --steps 60
    python benchmarks/auto_ranking.py --layouts ddp fsdp megatron-pp2 --extra model.n_layers=2

Timing figures on a shared host are only as good as it is quiet: the load average is printed beside them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plan_accuracy import LAYOUTS
from train_cli import train_manifest

TARGET = 0.05


def common_overrides(steps: int, extra: list[str]) -> list[str]:
    return [
        f"trainer.max_steps={steps}",
        f"trainer.val_every_n_steps={steps}",
        "trainer.val_batches=1",
        "trainer.ckpt_every_n_steps=0",
        "trainer.global_batch_size=32",  # the same global batch for every layout (Megatron tp2 has dp=1)
        *extra,
    ]


def measured_step(manifest: dict) -> float:
    """The run's median step (what its prediction is compared with)."""
    measured = (manifest.get("prediction") or {}).get("measured") or {}
    step = measured.get("step_time_s") or (manifest.get("result") or {}).get("step_time_p50_s")
    if not step:
        raise SystemExit(f"auto_ranking: a run recorded no step time: {manifest.get('status')}")
    return float(step)


def one_repeat(layouts: list[str], rotation: int, steps: int, extra: list[str], keep: Path) -> dict[str, float]:
    """Median step of every layout, then of ``strategy=auto`` calibrated on this repeat's DDP run (key ``auto``)."""
    order = layouts[rotation % len(layouts) :] + layouts[: rotation % len(layouts)]
    steps_s: dict[str, float] = {}
    for name in order:

        def inspect(run_dir: Path, name: str = name) -> None:
            shutil.copytree(run_dir, keep / name, dirs_exist_ok=True)

        manifest = train_manifest([*LAYOUTS[name], *common_overrides(steps, extra)], inspect)
        steps_s[name] = measured_step(manifest)
        print(f"    {name}: {steps_s[name] * 1e3:.0f} ms (load {os.getloadavg()[0]:.1f})", flush=True)
    calibration = keep / "ddp"
    manifest = train_manifest(["strategy=auto", f"calibration={calibration}", *common_overrides(steps, extra)])
    steps_s["auto"] = measured_step(manifest)
    chosen = (manifest.get("prediction") or {}).get("layout") or (manifest.get("strategy_resolved") or {}).get("name")
    print(f"    auto -> {chosen}: {steps_s['auto'] * 1e3:.0f} ms", flush=True)
    picked = layout_of(manifest.get("strategy_resolved") or {}, order)
    if picked is not None:  # the pick's own run of this repeat: the ranking without two runs of one layout's noise
        steps_s["auto_pick"] = steps_s[picked]
    return steps_s


def layout_of(strategy: dict, layouts: list[str]) -> str | None:
    """The first benchmark layout whose overrides the resolved strategy config carries (None: auto chose another)."""

    def matches(override: str) -> bool:
        key, value = override.split("=", 1)
        field = "name" if key == "strategy" else key.removeprefix("strategy.")
        return str(strategy.get(field)) == value

    return next((name for name in layouts if all(matches(o) for o in LAYOUTS[name])), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS))
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--extra", nargs="*", default=[], help="extra `python -m train` overrides for every run")
    args = parser.parse_args()
    if "ddp" not in args.layouts:
        sys.exit("auto_ranking: --layouts must include ddp (auto is calibrated on the repeat's DDP run)")
    ratios: list[float] = []
    pick_ratios: list[float] = []  # the same repeat's run of the layout auto picked, over the fastest
    loads: list[float] = []
    per_layout: dict[str, list[float]] = {}
    for repeat in range(args.repeats):
        print(f"repeat {repeat + 1}:", flush=True)
        with tempfile.TemporaryDirectory() as tmp:
            steps_s = one_repeat(args.layouts, repeat, args.steps, args.extra, Path(tmp))
        loads.append(os.getloadavg()[0])
        for name, seconds in steps_s.items():
            per_layout.setdefault(name, []).append(seconds)
        fastest = min(steps_s[name] for name in args.layouts)
        ratios.append(steps_s["auto"] / fastest)
        print(f"  auto / fastest measured: {ratios[-1]:.3f}", flush=True)
        if "auto_pick" in steps_s:
            pick_ratios.append(steps_s.pop("auto_pick") / fastest)
            print(f"  the picked layout's own run / fastest: {pick_ratios[-1]:.3f}", flush=True)
    print("\nmedian step over repeats (min..max):")
    for name, values in per_layout.items():
        span = f"{min(values) * 1e3:.0f}..{max(values) * 1e3:.0f}"
        print(f"  {name:<14} {statistics.median(values) * 1e3:8.0f} ms ({span})")
    ratio = statistics.median(ratios)
    print(f"host load (1-minute average) after each repeat: {', '.join(f'{x:.1f}' for x in loads)}")
    verdict = "met" if ratio <= 1 + TARGET else "not met"
    print(f"auto's step / the fastest layout's, median over repeats: {ratio:.3f} (<= {1 + TARGET:.2f}: {verdict})")
    if pick_ratios:
        # Auto's own run and its pick's run are two runs of one layout: their difference is the box's noise, not the
        # ranking. The pick's own run against the fastest of the same repeat is the ranking alone.
        print(f"the picked layout's own run / the fastest, median over repeats: {statistics.median(pick_ratios):.3f}")
    print(json.dumps({"ratios": ratios, "pick_ratios": pick_ratios, "loads": loads}))


if __name__ == "__main__":
    main()
