"""The training loss curve a run logged, by step, for the keep rule's comparison of two arms over the same steps.

The CSV logger (the default) writes ``train/loss`` every ``trainer.log_every_n_steps``; a run with another logger
still has its final train loss in ``run.json``, which is then the one step compared.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

METRICS_CSV = Path("metrics") / "metrics.csv"


def _finite(text: object) -> float | None:
    try:
        value = float(str(text))
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def read_losses(run_dir: Path) -> dict[int, float]:
    """``{step: train loss}`` from ``run_dir``'s metrics.csv, else ``{steps: final loss}`` from run.json; {} if none."""
    losses: dict[int, float] = {}
    metrics = Path(run_dir) / METRICS_CSV
    if metrics.is_file():
        with metrics.open(encoding="utf-8", newline="") as rows:
            for row in csv.DictReader(rows):
                loss, step = _finite(row.get("train/loss", "")), _finite(row.get("step", ""))
                if loss is not None and step is not None:
                    losses[int(step)] = loss
    if losses:
        return losses
    try:
        result = json.loads((Path(run_dir) / "run.json").read_text(encoding="utf-8")).get("result") or {}
    except (OSError, ValueError):
        return {}
    loss, steps = _finite(result.get("train_loss")), result.get("steps")
    return {int(steps): loss} if loss is not None and isinstance(steps, int) else {}
