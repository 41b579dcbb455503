"""A/B verdict files: ``RUN/ab/setN/verdict.{md,json}`` per set and ``RUN/ab/verdict.{md,json}`` over all sets.

The top-level files hold, per recommendation (keyed by its override), the verdict of the newest set that
tested it; the report of the original run reads them to show a tested recommendation as such.
"""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path
from typing import Any

from diagnostics.ab.runner import AB_DIR, AbSet, ArmRuns, RunOutcome
from diagnostics.ab.stats import CONFIDENCE, METHOD, RESOLUTION, arm_stats, judge

VERDICT_JSON = "verdict.json"
VERDICT_MD = "verdict.md"
MERGE_LOCK = ".verdict.lock"  # held while the merged verdict is read and rewritten
SCHEMA_VERSION = 1


def _arm_json(runs: list[RunOutcome], run_root: Path, metric: str) -> dict[str, Any]:
    stats = arm_stats([r.rate(metric) for r in runs])
    return {
        "median_tokens_per_s": stats.median,
        "min_tokens_per_s": stats.low,
        "max_tokens_per_s": stats.high,
        "spread": stats.spread,
        "runs": stats.runs,
        "failed": stats.failed,
        "tokens_per_s": [r.rate(metric) for r in runs],
        "run_dirs": [os.path.relpath(r.run_dir, run_root) for r in runs],
        "errors": [r.error for r in runs if r.error],
    }


def _test_json(ab: AbSet, runs: ArmRuns, run_root: Path) -> dict[str, Any]:
    rounds = sorted(runs.rounds)
    original = [ab.arms[0].rounds[r] for r in rounds]
    mine = [runs.rounds[r] for r in rounds]
    metric = runs.arm.metric
    label = next((r.rate_label for r in [*original, *mine] if r.tokens_per_s is not None), "tokens/s")
    verdict = judge([r.rate(metric) for r in original], [r.rate(metric) for r in mine], label)
    change = verdict.change
    expected = expected_change(runs.arm.expected_gain)
    return {
        "override": runs.arm.label,
        # The recommendation's own prediction, as a tokens/s change, beside what the rounds measured.
        "expected_change": expected,
        "prediction_error": (change.estimate - expected) if change and expected is not None else None,
        "set": ab.set_dir.name,
        "arm": runs.arm.name,
        "verdict": verdict.verdict,
        "reason": verdict.reason,
        "change": change.estimate if change else None,
        "ci": [change.low, change.high] if change else None,
        "pairs": change.pairs if change else 0,
        "resolved": change.resolved if change else False,
        "rounds": rounds,
        # tokens_per_s: the training steps' rate; loop_tokens_per_s: the loop's, validation and checkpoints included.
        "metric": metric,
        "rate_label": label,  # the unit of every *_tokens_per_s figure here: tokens/s, or a sample run's samples/s
        "original": _arm_json(original, run_root, metric),
        "recommended": _arm_json(mine, run_root, metric),
        "command": {"original": list(ab.arms[0].arm.overrides), "recommended": list(runs.arm.overrides)},
    }


def expected_change(gain: float | None) -> float | None:
    """The tokens/s change a recommendation that saves ``gain`` of the step predicts: 1 / (1 - gain) - 1."""
    if gain is None or not 0.0 <= gain < 1.0:
        return None
    return 1.0 / (1.0 - gain) - 1.0


def prediction_error_points(data: dict[str, Any]) -> tuple[float, int] | None:
    """Median absolute difference between the predicted and the measured tokens/s change, in percentage points, over
    the tested recommendations that carry both (how well the report's expected gains predict what A/B measures)."""
    errors = sorted(
        abs(v["prediction_error"]) for v in data.get("recommendations", []) if v.get("prediction_error") is not None
    )
    if not errors:
        return None
    mid = len(errors) // 2
    median = errors[mid] if len(errors) % 2 else (errors[mid - 1] + errors[mid]) / 2
    return 100 * median, len(errors)


def set_verdict(ab: AbSet, run_dir: Path) -> dict[str, Any]:
    """The JSON verdict of one A/B set; run dirs are relative to the original run's directory."""
    return {
        "schema_version": SCHEMA_VERSION,
        "run_dir": str(run_dir),
        "method": METHOD,
        "confidence": CONFIDENCE,
        "resolution": RESOLUTION,
        "sets": [ab.set_dir.name],
        "recommendations": [_test_json(ab, runs, Path(run_dir).resolve()) for runs in ab.arms[1:]],
    }


def read_verdict(run_dir: Path) -> dict[str, Any] | None:
    """``RUN/ab/verdict.json``, or None when no A/B ran (or the file is unreadable)."""
    try:
        data = json.loads((Path(run_dir) / AB_DIR / VERDICT_JSON).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("recommendations"), list) else None


def verdicts_by_override(run_dir: Path) -> dict[str, dict[str, Any]]:
    """The newest verdict of every tested recommendation, keyed by its override."""
    data = read_verdict(run_dir) or {}
    return {v["override"]: v for v in data.get("recommendations", []) if isinstance(v, dict) and "override" in v}


def merged(previous: dict[str, Any] | None, new: dict[str, Any]) -> dict[str, Any]:
    """``new`` plus the verdicts of ``previous`` for recommendations that ``new`` did not test again."""
    if not previous:
        return new
    retested = {v["override"] for v in new["recommendations"]}
    kept = [v for v in previous.get("recommendations", []) if v.get("override") not in retested]
    sets = [s for s in previous.get("sets", []) if s not in new["sets"]] + new["sets"]
    return {**new, "sets": sets, "recommendations": new["recommendations"] + kept}


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:+.1%}"


def _rate(x: float | None) -> str:
    return "n/a" if x is None else f"{x:,.0f}"


def phrase(v: dict[str, Any]) -> str:
    """One line for a report: ``confirmed +12.0% (95% CI +8.1% .. +16.0%, 3 rounds)``."""
    if v.get("verdict") == "failed":
        rec = v.get("recommended") or {}
        return f"failed ({rec.get('failed')} of {rec.get('runs')} runs of the recommended arm failed)"
    if v.get("change") is None or not v.get("ci"):
        return str(v.get("verdict"))
    low, high = v["ci"]
    return f"{v['verdict']} {_pct(v['change'])} ({CONFIDENCE:.0%} CI {_pct(low)} .. {_pct(high)}, {v['pairs']} rounds)"


def to_markdown(data: dict[str, Any]) -> str:
    lines = [
        f"# A/B verdict: {data['run_dir']}",
        "",
        f"Sets: {', '.join(data['sets'])}. Arms ran interleaved, round by round. Change: {data['method']}; a change "
        f"is resolved when its interval excludes zero or lies within ±{data['resolution']:.0%}.",
        "",
        f"| recommendation | verdict | change | CI | original {_label(data)}: median (min .. max), spread | "
        f"recommended {_label(data)}: median (min .. max), spread | failed runs (A / B) |",
        "|---|---|---|---|---|---|---|",
    ]
    for v in data["recommendations"]:
        ci = f"{_pct(v['ci'][0])} .. {_pct(v['ci'][1])}" if v.get("ci") else "n/a"
        arms = []
        for arm in (v["original"], v["recommended"]):
            spread = "n/a" if arm["spread"] is None else f"{arm['spread']:.1%}"
            low, high = _rate(arm["min_tokens_per_s"]), _rate(arm["max_tokens_per_s"])
            arms.append(f"{_rate(arm['median_tokens_per_s'])} ({low} .. {high}), {spread}")
        failed = f"{v['original']['failed']} / {v['recommended']['failed']}"
        row = [f"`{v['override']}`", v["verdict"], _pct(v["change"]), ci, *arms, failed]
        lines.append("| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |")
    for v in data["recommendations"]:
        lines += ["", f"## `{v['override']}` ({v['set']}, arm {v['arm']}): {v['verdict']}", "", v["reason"], ""]
        if v.get("metric") == "loop_tokens_per_s":
            lines += [f"Compared: {metric_label(v)} (the lever changes time outside the training steps).", ""]
        rate = v.get("rate_label", "tokens/s")
        lines.append(f"| round | original {rate} | recommended {rate} | run dirs |")
        lines.append("|---|---|---|---|")
        a, b = v["original"], v["recommended"]
        for i, round_no in enumerate(v["rounds"]):
            dirs = f"{a['run_dirs'][i]}, {b['run_dirs'][i]}"
            lines.append(f"| {round_no} | {_rate(a['tokens_per_s'][i])} | {_rate(b['tokens_per_s'][i])} | {dirs} |")
        if a["errors"] or b["errors"]:
            lines += ["", *(f"- failed: {err}" for err in a["errors"] + b["errors"])]
    return "\n".join(lines) + "\n"


def _label(data: dict[str, Any]) -> str:
    """The verdict table's unit: its tests' one unit (a run's tests all share it), else ``rate``."""
    labels = {v.get("rate_label", "tokens/s") for v in data["recommendations"]}
    return labels.pop() if len(labels) == 1 else "rate"


def metric_label(test: dict[str, Any]) -> str:
    """What a test's figures are: the training steps' rate, or the loop's wall-clock rate, in the run's unit."""
    rate = test.get("rate_label", "tokens/s")
    if test.get("metric") == "loop_tokens_per_s":
        return f"wall-clock {rate} (validation and checkpoints included)"
    return rate


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def write_verdict(ab: AbSet, run_dir: Path) -> dict[str, Any]:
    """Write the set's verdict files and the merged ``RUN/ab/verdict.{md,json}``; returns the merged verdict."""
    new = set_verdict(ab, run_dir)
    _write(ab.set_dir / VERDICT_JSON, json.dumps(new, indent=2) + "\n")
    _write(ab.set_dir / VERDICT_MD, to_markdown(new))
    ab_dir = Path(run_dir) / AB_DIR
    # Read, merge, write: two A/Bs of one run ending at once would each write the merge without the other's set.
    with (ab_dir / MERGE_LOCK).open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        everything = merged(read_verdict(run_dir), new)
        _write(ab_dir / VERDICT_JSON, json.dumps(everything, indent=2) + "\n")
        _write(ab_dir / VERDICT_MD, to_markdown(everything))
    return everything


def text_table(data: dict[str, Any], set_name: str | None = None) -> str:
    """The console lines of a verdict: one per recommendation (of ``set_name`` only, when given)."""
    lines = []
    for v in data["recommendations"]:
        if set_name is not None and v["set"] != set_name:
            continue
        a, b = v["original"], v["recommended"]
        predicted = f"; expected {_pct(v['expected_change'])}" if v.get("expected_change") is not None else ""
        lines.append(
            f"  {v['override']}: {phrase(v)}{predicted}; {metric_label(v)} median {_rate(a['median_tokens_per_s'])} -> "
            f"{_rate(b['median_tokens_per_s'])} (spread {_spread(a)} / {_spread(b)})"
        )
    if set_name is None and (error := prediction_error_points(data)) is not None:
        lines.append(
            f"  expected vs measured change: median absolute error {error[0]:.1f} points over {error[1]} test(s)"
        )
    return "\n".join(lines)


def _spread(arm: dict[str, Any]) -> str:
    return "n/a" if arm["spread"] is None else f"{arm['spread']:.1%}"
