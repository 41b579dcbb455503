"""Predicted vs measured: the relative error of each figure the planner predicted for a run.

One comparison for run.json (written at the end of a run), the report and the sweep report. The quantities:
step time, tokens/s, MFU (both against the peak the prediction used), communication time per step (every
collective, hidden or not), peak device memory (GPU allocator peak) and the training state (parameters, gradients
and optimizer states: what is measured on CPU, where the peak RSS also holds the runtime and activations come
and go).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from diagnostics.diagnosis import Analysis

COMPARED = {
    "step_time_s": "step time",
    "tokens_per_s": "tokens/s",
    "mfu": "MFU",
    "comm_s": "communication per step",
    "memory_bytes": "peak device memory",
    "state_bytes": "training state (params+grads+optimizer)",
}


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or value != value or value <= 0:
        return None
    return float(value)


def compare(predicted: dict[str, Any], measured: dict[str, Any]) -> dict[str, float]:
    """predicted / measured - 1 for every quantity both sides have (positive: the planner said more)."""
    errors = {}
    for key in COMPARED:
        p, m = _number(predicted.get(key)), _number(measured.get(key))
        if p is not None and m is not None:
            errors[key] = p / m - 1.0
    return errors


def format_value(key: str, value: Any) -> str:
    v = _number(value)
    if v is None:
        return "n/a"
    if key.endswith("_bytes"):
        return f"{v / 2**30:.3f} GiB"
    if key == "tokens_per_s":
        return f"{v:,.0f}"
    if key.endswith("_s"):
        return f"{v * 1e3:.1f} ms"
    if key == "mfu":
        return f"{v:.1%}"
    return f"{v:,.0f}"


def comparison_rows(record: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """(quantity, predicted, measured, error) for a run.json ``prediction`` record, in ``COMPARED`` order."""
    predicted, measured = record.get("predicted") or {}, record.get("measured") or {}
    errors = compare(predicted, measured)
    rows = []
    for key, label in COMPARED.items():
        if key not in predicted and key not in measured:
            continue
        error = f"{errors[key]:+.0%}" if key in errors else "n/a"
        rows.append((label, format_value(key, predicted.get(key)), format_value(key, measured.get(key)), error))
    return rows


def basis_text(record: dict[str, Any]) -> str:
    """``peak_tflops measured, intra_node_bandwidth_gbps measured, ...`` (what the prediction's numbers came from)."""
    basis = record.get("basis") or {}
    return ", ".join(f"{name} {source}" for name, source in basis.items()) or "unknown"


def measured_from_analysis(analysis: Analysis, predicted: dict[str, Any]) -> dict[str, Any]:
    """What the telemetry measured of each compared quantity. Collective time is the minimum over ranks (a rank's
    collective time includes waiting for the slowest peer); memory is the largest rank's."""
    s, phases = analysis.summary, analysis.phases
    measured: dict[str, Any] = {"step_time_s": s.step_time.get("p50"), "tokens_per_s": s.tokens_per_s}
    p_tps, p_mfu = _number(predicted.get("tokens_per_s")), _number(predicted.get("mfu"))
    if p_tps and p_mfu and (tokens_per_s := _number(s.tokens_per_s)):
        measured["mfu"] = p_mfu * tokens_per_s / p_tps  # the same FLOPs per token and peak as the prediction
    comm = [p.profile_comm_s for p in phases if p.profile_comm_s is not None]
    # Under pipelining the profile's sends and receives last as long as a stage waits for its neighbour: the bubble,
    # not the link time the planner predicts (a pipelined run's profile read 25 times the link time:
    # benchmarks/RESULTS.md, "Figures moved from the code").
    pipelined = any(p.profile_collective_share < 1.0 for p in phases)
    if comm and not pipelined:
        measured["comm_s"] = min(comm)
    for key, field in (("memory_bytes", "peak_allocated_bytes"), ("state_bytes", "training_state_bytes")):
        values = [getattr(p, field) for p in phases if getattr(p, field) is not None]
        if values:
            measured[key] = max(values)
    return {k: v for k, v in measured.items() if v is not None}


def prediction_of(analysis: Analysis) -> dict[str, Any] | None:
    """run.json's ``prediction`` with the telemetry's measurements and the errors (None: nothing predicted)."""
    record = analysis.run.manifest.prediction if analysis.run.manifest is not None else None
    if not isinstance(record, dict) or not isinstance(record.get("predicted"), dict):
        return None
    measured = {**(record.get("measured") or {}), **measured_from_analysis(analysis, record["predicted"])}
    record = {**record, "measured": measured, "error": compare(record["predicted"], measured)}
    if isinstance(record.get("datasheet"), dict):
        record["datasheet_error"] = compare(record["datasheet"], measured)
    return record


def one_line(record: dict[str, Any]) -> str:
    """``planner: step 120.0 ms predicted vs 131.0 ms measured (-8%), ...`` for the end-of-run summary."""
    errors = compare(record.get("predicted") or {}, record.get("measured") or {})
    parts = []
    for key in ("step_time_s", "comm_s", "memory_bytes", "state_bytes"):
        if key in errors:
            predicted, measured = record["predicted"][key], record["measured"][key]
            parts.append(
                f"{COMPARED[key].split(' (')[0]} {format_value(key, predicted)} vs {format_value(key, measured)} "
                f"({errors[key]:+.0%})"
            )
    if not parts:
        why = record.get("unpredicted")
        return f"planner: step time not predicted: {why}" if why else "planner: nothing comparable was measured"
    basis = "calibrated" if "measured" in (record.get("basis") or {}).values() else "datasheet"
    line = f"planner ({basis}) predicted vs measured: " + ", ".join(parts)
    sheet = compare(record.get("datasheet") or {}, record.get("measured") or {})
    if "step_time_s" in sheet:  # a calibrated GPU run: what the datasheet alone would have said
        line += f"; datasheet alone: step time {format_value('step_time_s', record['datasheet']['step_time_s'])} "
        line += f"({sheet['step_time_s']:+.0%})"
    return line
