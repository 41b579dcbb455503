"""Overhead on a user's own LightningModule: ``python -m train`` (diagnostics on) against a plain ``Trainer.fit`` of
the same module with the same Lightning DDP strategy, process count, threads, batch, steps and logging (a CSV logger
every 10 steps, as a user's Trainer logs by default).

The module is tests/lightning_projects' conv-net classifier (or ``--project regressor``/``recommender``), plain
Lightning code. Both arms time optimizer steps after the same warm-up and report the median step (the steady
rate; a burst of other work on this shared machine moves a median far less than a mean). The arms are interleaved,
their order rotated every repeat; the ratio plain / disttrain of the median steps is printed per repeat and as the
median with its spread and quartiles, beside the ratio of each arm's fastest run: on this VM a whole run lands in a
fast or a slow regime (gloo's small calls are bimodal between runs, benchmarks/RESULTS.md), so many short repeats
say more than a few long ones. Target: >= 0.97 (disttrain at most 3% slower), a difference counted only beyond the
spread.

    python benchmarks/user_module_overhead.py                        # classifier, micro 64, 8 repeats of 150 steps
    python benchmarks/user_module_overhead.py --repeats 12 --steps 120 --micro 128

Run it on a quiet box (no suite, no helper beside it); the load average is printed with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROJECTS = {
    "classifier": (
        "tests.lightning_projects.classifier",
        lambda m: m.LitClassifier(m.ConvNet()),
        lambda m, micro: m.DigitsData(batch_size=micro),
        ["+model._target_={p}.LitClassifier", "+model.net._target_={p}.ConvNet", "+data._target_={p}.DigitsData"],
    ),
    "regressor": (
        "tests.lightning_projects.regressor",
        lambda m: m.LitRegressor(),
        lambda m, micro: m.WaveData(batch_size=micro),
        ["+model._target_={p}.LitRegressor", "+data._target_={p}.WaveData"],
    ),
    "recommender": (
        "tests.lightning_projects.recommender",
        lambda m: m.LitRecommender(),
        lambda m, micro: m.RatingsData(batch_size=micro),
        ["+model._target_={p}.LitRecommender", "+data._target_={p}.RatingsData"],
    ),
}
WORLD = 2


def plain_fit(project: str, steps: int, micro: int, warmup: int, out: Path) -> None:
    """The arm a user would write: ``Trainer.fit`` with Lightning's DDP (it re-runs this script as rank 1)."""
    import importlib

    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.loggers import CSVLogger
    from lightning.pytorch.strategies import DDPStrategy

    sys.path.insert(0, str(REPO))  # the projects' package, as ``python -m train`` run from the repo finds it
    torch.set_num_threads(max(1, (os.cpu_count() or WORLD) // WORLD))  # as disttrain's default: cores / local ranks
    name, build_module, build_data, _ = PROJECTS[project]
    module = importlib.import_module(name)
    pl.seed_everything(1337, verbose=False)

    class StepClock(pl.Callback):
        def __init__(self) -> None:
            self.ends: list[float] = []

        def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
            self.ends.append(time.perf_counter())

    clock = StepClock()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=WORLD,
        strategy=DDPStrategy(process_group_backend="gloo"),
        max_steps=steps,
        limit_val_batches=0,
        # A user's Trainer logs (Lightning's default logger); the CSV one, every 10 steps as disttrain's default.
        logger=CSVLogger(str(out.parent / f"{out.stem}-logs")),
        log_every_n_steps=10,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[clock],
    )
    trainer.fit(build_module(module), datamodule=build_data(module, micro))
    if trainer.is_global_zero:
        durations = [b - a for a, b in zip(clock.ends[warmup:], clock.ends[warmup + 1 :], strict=False)]
        out.write_text(json.dumps({"step_time_p50_s": statistics.median(durations)}))


def disttrain_fit(project: str, steps: int, micro: int, run_dir: Path, extra: list[str]) -> float:
    name, _, _, targets = PROJECTS[project]
    args = [
        "~model", "~data", *(t.format(p=name) for t in targets), f"trainer.max_steps={steps}",
        f"trainer.micro_batch_size={micro}", f"trainer.val_every_n_steps={steps + 1}", "trainer.ckpt_every_n_steps=0",
        "trainer.grad_clip=0", "precision=fp32", "strategy=ddp", *extra, f"hydra.run.dir={run_dir}",
    ]  # fmt: skip
    subprocess.run([sys.executable, "-m", "train", *args], cwd=REPO, check=True, capture_output=True)
    result = json.loads((run_dir / "run.json").read_text())["result"]
    return float(result["step_time_p50_s"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--project", choices=sorted(PROJECTS), default="classifier")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--micro", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--extra", nargs="*", default=[], help="more train overrides (e.g. diagnostics=off)")
    parser.add_argument("--plain-out", type=Path, help=argparse.SUPPRESS)  # the plain arm's own process
    args = parser.parse_args()
    warmup = min(10, args.steps // 10)  # Throughput's skip_steps: the same warm-up on both sides
    if args.plain_out is not None:
        plain_fit(args.project, args.steps, args.micro, warmup, args.plain_out)
        return
    print(
        f"load average before: {os.getloadavg()[0]:.2f}; {args.project}, micro {args.micro} x {WORLD} ranks", args.extra
    )
    ratios, plains, ours = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            arms = ["plain", "disttrain"] if repeat % 2 == 0 else ["disttrain", "plain"]
            times: dict[str, float] = {}
            for arm in arms:
                if arm == "plain":
                    out = Path(tmp) / f"plain{repeat}.json"
                    command = [sys.executable, __file__, "--project", args.project, "--steps", str(args.steps),
                               "--micro", str(args.micro), "--plain-out", str(out)]  # fmt: skip
                    subprocess.run(command, cwd=REPO, check=True, capture_output=True)
                    times[arm] = json.loads(out.read_text())["step_time_p50_s"]
                else:
                    run_dir = Path(tmp) / f"run{repeat}"
                    times[arm] = disttrain_fit(args.project, args.steps, args.micro, run_dir, args.extra)
            ratio = times["plain"] / times["disttrain"]
            ratios.append(ratio)
            plains.append(times["plain"])
            ours.append(times["disttrain"])
            print(
                f"repeat {repeat}: plain {1e3 * times['plain']:.2f} ms, disttrain {1e3 * times['disttrain']:.2f} ms "
                f"median step; plain / disttrain {ratio:.3f}"
            )
    quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    print(
        f"plain / disttrain (median step): median {statistics.median(ratios):.3f} "
        f"(spread {min(ratios):.3f} .. {max(ratios):.3f}, quartiles {quartiles[0]:.3f} .. {quartiles[2]:.3f}) over "
        f"{args.repeats} repeats; median steps {1e3 * statistics.median(plains):.2f} ms vs "
        f"{1e3 * statistics.median(ours):.2f} ms (ratio {statistics.median(plains) / statistics.median(ours):.3f}); "
        f"fastest runs {1e3 * min(plains):.2f} ms vs {1e3 * min(ours):.2f} ms (ratio {min(plains) / min(ours):.3f}); "
        f"load average after: {os.getloadavg()[0]:.2f}"
    )


if __name__ == "__main__":
    main()
