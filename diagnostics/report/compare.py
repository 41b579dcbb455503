"""What changed between two runs and why: config diff, metric deltas, findings that came and went.

A change is linked to a finding when run A recommended that key for it: "data.num_workers 0 -> 4 was
recommended in A for input_bound; input_bound is gone in B (metric 0.47 -> none)".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from diagnostics.analysis import Finding
from diagnostics.analysis.context import hydra_value
from diagnostics.report.fmt import flatten, gib, pct, peak_memory, rate, seconds
from diagnostics.report.model import Report

ABSENT = "(absent)"


def _key_of(override_key: str) -> str:
    """The flattened config key an override sets (``strategy`` -> ``strategy.name``)."""
    bare = override_key.lstrip("+~")
    return bare if "." in bare else f"{bare}.name"


@dataclass
class Comparison:
    a: Report
    b: Report
    config_changes: list[tuple[str, Any, Any]] = field(default_factory=list)
    metrics: list[tuple[str, str, str, str]] = field(default_factory=list)  # name, A, B, change
    appeared: list[Finding] = field(default_factory=list)
    disappeared: list[Finding] = field(default_factory=list)
    persisted: list[tuple[Finding, Finding]] = field(default_factory=list)
    explanations: list[str] = field(default_factory=list)

    def text(self) -> str:
        lines = [f"A: {self.a.run_dir}", f"B: {self.b.run_dir}", "", "config changes (A -> B):"]
        lines += [f"  {k}: {va} -> {vb}" for k, va, vb in self.config_changes] or ["  none (same config)"]
        lines += ["", "metrics (A -> B):"]
        lines += [f"  {name:<20} {va:>14} -> {vb:<14} {change}" for name, va, vb, change in self.metrics]
        lines += ["", "findings:"]
        lines += [f"  gone in B:  {f.kind} ({f.severity}): {f.message}" for f in self.disappeared]
        lines += [f"  new in B:   {f.kind} ({f.severity}): {f.message}" for f in self.appeared]
        lines += [f"  still in B: {fb.kind} ({fa.severity} -> {fb.severity})" for fa, fb in self.persisted]
        if not (self.disappeared or self.appeared or self.persisted):
            lines.append("  none in either run")
        lines += ["", "why:"] + ([f"  {e}" for e in self.explanations] or ["  no config change explains a difference"])
        return "\n".join(lines)


def _relative(a: float | None, b: float | None, higher_is_better: bool) -> str:
    if a is None or b is None or a == 0:
        return ""
    change = (b - a) / abs(a)
    better = change > 0 if higher_is_better else change < 0
    return f"{change:+.1%} ({'better' if better else 'worse'})" if abs(change) >= 0.005 else "(same)"


def _metrics(a: Report, b: Report) -> list[tuple[str, str, str, str]]:
    sa, sb = a.analysis.summary, b.analysis.summary

    def mfu(s) -> float | None:
        return s.mfu if s.mfu is not None else s.calibrated_mfu

    ma, mb = peak_memory(sa.peak_memory)[1], peak_memory(sb.peak_memory)[1]
    pa, pb = sa.step_time.get("p50"), sb.step_time.get("p50")
    step_change = _relative(pa, pb, False)
    ta, tb = a.analysis.run.meta("tokens_per_step"), b.analysis.run.meta("tokens_per_step")
    if ta and tb and ta != tb:  # a step of a different batch is not comparable: tokens/s is
        step_change = f"(tokens per step {ta} -> {tb}: compare tokens/s)"
    rows = [
        ("tokens/s", rate(sa.tokens_per_s), rate(sb.tokens_per_s), _relative(sa.tokens_per_s, sb.tokens_per_s, True)),
        ("MFU", pct(mfu(sa)), pct(mfu(sb)), _relative(mfu(sa), mfu(sb), True)),
        ("step time p50", seconds(pa), seconds(pb), step_change),
        ("peak memory", gib(ma), gib(mb), _relative(ma, mb, False)),
    ]
    la, lb = ((s.loop or {}).get("loop_tokens_per_s") for s in (sa, sb))
    if la and lb and any((s.loop or {}).get("paused_s") for s in (sa, sb)):
        # Validation and checkpoint writes: what the loop delivered with them (the steps' rate above leaves them out).
        rows.insert(1, ("tokens/s with pauses", rate(la), rate(lb), _relative(la, lb, True)))
    return rows


def _explain(cmp: Comparison) -> list[str]:
    changed = {k for k, _, _ in cmp.config_changes}
    by_kind_b = {f.kind: f for f in cmp.b.findings}
    out: list[str] = []
    linked: set[str] = set()
    for finding, recs in zip(cmp.a.findings, cmp.a.recommendations, strict=True):
        for rec in recs:
            if not rec.key or _key_of(rec.key) not in changed:
                continue
            group = rec.key.lstrip("+~") + "." if "." not in rec.key else None  # a group swap changes its options
            pinned = {_key_of(p.split("=", 1)[0]) for p in rec.pinned}
            linked.update(k for k in changed if k == _key_of(rec.key) or k in pinned or (group and k.startswith(group)))
            change = next((f"{k}: {va} -> {vb}" for k, va, vb in cmp.config_changes if k == _key_of(rec.key)), "")
            after = by_kind_b.get(finding.kind)
            if after is None:
                outcome = f"{finding.kind} is gone in B"
            else:
                outcome = f"{finding.kind} persists in B ({finding.severity} -> {after.severity})"
                if finding.metric is not None and after.metric is not None:
                    outcome += f", graded metric {finding.metric:.3g} -> {after.metric:.3g}"
            out.append(f"{change} was recommended in A for {finding.kind} (`{rec.override}`); {outcome}")
    for finding in cmp.appeared:
        out.append(f"{finding.kind} is new in B: check whether the config changes above cause it ({finding.message})")
    unlinked = sorted(changed - linked)
    if unlinked:
        out.append(f"changes not from A's recommendations: {', '.join(unlinked)}")
    return out


def _shown(config: dict[str, Any], key: str) -> str:
    """A config value as it would be written in an override (null, true), or ``(absent)``."""
    return hydra_value(config[key]) if key in config else ABSENT


def compare_reports(a: Report, b: Report) -> Comparison:
    """Config diff (from run.json), metric deltas and finding changes of run B against run A."""
    cmp = Comparison(a, b)
    ca, cb = flatten(a.context()["config"]), flatten(b.context()["config"])
    pairs = [(k, _shown(ca, k), _shown(cb, k)) for k in sorted(set(ca) | set(cb))]
    cmp.config_changes = [(k, va, vb) for k, va, vb in pairs if va != vb]
    cmp.metrics = _metrics(a, b)
    kinds_a, kinds_b = {f.kind: f for f in a.findings}, {f.kind: f for f in b.findings}
    cmp.disappeared = [f for k, f in kinds_a.items() if k not in kinds_b]
    cmp.appeared = [f for k, f in kinds_b.items() if k not in kinds_a]
    cmp.persisted = [(f, kinds_b[k]) for k, f in kinds_a.items() if k in kinds_b]
    cmp.explanations = _explain(cmp)
    return cmp
