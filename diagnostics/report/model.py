"""The report object: an analysis plus its recommendations, as JSON and as a short text for the end of a run."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diagnostics.ab.runner import AB_DIR
from diagnostics.ab.verdict import VERDICT_MD, phrase
from diagnostics.analysis import Finding
from diagnostics.analysis import thresholds as thresholds_module
from diagnostics.analysis.context import RunContext
from diagnostics.analysis.stats import rounded
from diagnostics.analysis.tail import tail_line
from diagnostics.analysis.thresholds import COST_WARNING
from diagnostics.diagnosis import Analysis
from diagnostics.kinds.levers import Recommendation
from diagnostics.kinds.pauses import PAUSES_MIN_SHARE
from diagnostics.kinds.registry import REGISTRY
from diagnostics.prediction import one_line, prediction_of
from diagnostics.report.fmt import flatten, gib, pct, peak_memory, rate, scale_of, scale_of_rec, seconds

SCHEMA_VERSION = 1
TEXT_FINDINGS = 7  # the end-of-run summary stays within ~12 lines


def _round_tree(value: Any) -> Any:
    if isinstance(value, float):
        return rounded(value, 6)
    if isinstance(value, dict):
        return {str(k): _round_tree(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_round_tree(v) for v in value]
    return value


def thresholds() -> dict[str, float | int]:
    """Every value the detectors decide on: the shared ones (analysis/thresholds.py) and each kind's own."""
    shared = {k: v for k, v in vars(thresholds_module).items() if k.isupper() and isinstance(v, int | float)}
    return {**shared, **{name: value for kind in REGISTRY.values() for name, value in kind.thresholds.items()}}


def ended_run(finding: Finding) -> bool:
    """Whether ``finding`` is what ended the run (a crash, a non-finite stop) rather than a cost per step."""
    return finding.kind == "crash" or (finding.kind == "nonfinite" and finding.evidence.get("action") == "stopped")


@dataclass
class Report:
    run_dir: Path
    analysis: Analysis
    recommendations: list[list[Recommendation]]  # parallel to analysis.findings
    generated_at: float = dataclasses.field(default_factory=time.time)
    written_to: Path | None = None  # the report/ directory once write_report ran
    # RUN/ab/verdict.json's newest verdict per tested override (``python -m diagnose RUN --ab --run``).
    verdicts: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)

    @property
    def prediction(self) -> dict[str, Any] | None:
        """The planner's prediction for this run (run.json) beside what the telemetry measured, with errors."""
        return prediction_of(self.analysis)

    @property
    def findings(self) -> list[Finding]:
        return self.analysis.findings

    def kinds(self) -> list[str]:
        return [f.kind for f in self.findings]

    def context(self) -> dict[str, Any]:
        ctx = RunContext.from_run(self.analysis.run)
        config = flatten(ctx.config)
        return {
            "strategy": ctx.strategy,
            "precision": ctx.get("precision.name"),
            "hw": ctx.get("hw.name"),
            "model": ctx.get("model.name"),
            "data": ctx.get("data.name"),
            "world_size": self.analysis.summary.world_size,
            "batch": ctx.batch,
            "overrides": self.analysis.run.overrides,
            "config": config,
            # Each attempt's world size, global batch and accumulation (restarts; elastic ones change the world).
            "attempts": self.analysis.run.manifest.attempts if self.analysis.run.manifest is not None else [],
        }

    def to_json(self) -> dict[str, Any]:
        findings = []
        for finding, recs in zip(self.findings, self.recommendations, strict=True):
            # A recommendation is an override to try; what explains a finding without one is evidence.
            entry = {**finding.to_json(), "recommendations": [self._rec_json(r) for r in recs if r.override]}
            explained = [{"why": r.why, "expected_effect": r.expected_effect} for r in recs if not r.override]
            if explained:
                entry["explanation"] = explained
            findings.append(entry)
        return _round_tree(
            {
                "schema_version": SCHEMA_VERSION,
                "run_dir": str(self.run_dir),
                "generated_at": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(self.generated_at)),
                "summary": self.analysis.summary.to_json(),
                "per_rank": [dataclasses.asdict(p) for p in self.analysis.phases],
                "findings": findings,
                "context": self.context(),
                "problems": self.analysis.run.problems,
                "thresholds": thresholds(),
                "ab_verdict": f"{AB_DIR}/{VERDICT_MD}" if self.verdicts else None,
                "prediction": self.prediction,
            }
        )

    def verdict_of(self, rec: Recommendation) -> dict[str, Any] | None:
        """The A/B verdict of ``rec`` when it was tested, else None."""
        return self.verdicts.get(rec.override) if rec.override else None

    def _rec_json(self, rec: Recommendation) -> dict[str, Any]:
        tested = self.verdict_of(rec)
        if tested is None:
            return rec.to_json()
        keys = ("verdict", "change", "ci", "pairs", "set", "reason")
        return {**rec.to_json(), "verdict": {k: tested.get(k) for k in keys}}

    def next_step(self, recs: list[Recommendation]) -> str:
        """What the end-of-run line says to do for a finding: its first untested override, or what A/B found."""
        levers = [r for r in recs if r.override]
        if not levers:
            return " (no config lever: see report)"
        first, tested = levers[0], self.verdict_of(levers[0])
        if tested is None:
            return f" -> try {first.override}"
        if tested.get("verdict") == "confirmed":
            return f" -> {first.override}: A/B {phrase(tested)}"
        untested = next((r for r in levers if self.verdict_of(r) is None), None)
        nxt = f"try {untested.override}; " if untested else ""
        return f" -> {nxt}{first.override} was A/B-tested: {phrase(tested)}"

    def headline(self) -> str:
        s = self.analysis.summary
        if s.mfu is not None:
            mfu = f"MFU {pct(s.mfu)} (HFU {pct(s.hfu)}) of {s.peak_flops_source or 'datasheet'} peak"
        elif s.calibrated_mfu is not None:
            mfu = f"MFU {pct(s.calibrated_mfu)} (HFU {pct(s.calibrated_hfu)}) of calibrated peak"
        elif not s.flops_per_token:
            # A module whose work is lookups and elementwise ops (embedding tables) has no matmul FLOPs to count.
            mfu = "MFU n/a (no matmul or convolution FLOPs counted)"
        else:
            mfu = "MFU n/a (no peak known)"
        if s.accounting_errors:
            mfu += " [MFU accounting error: see report]"
        label, peak = peak_memory(s.peak_memory)
        st = s.step_time
        loop = s.loop or {}
        paused = ""
        if (loop.get("share") or 0.0) >= PAUSES_MIN_SHARE and loop.get("loop_tokens_per_s"):
            # The steps' rate is what the hardware does; with pauses this large, the run delivers less.
            paused = f" ({rate(loop['loop_tokens_per_s'])} with validation and checkpoints)"
        return (
            f"{rate(s.tokens_per_s)} {s.rate_label}{paused} | {mfu} | step p50 {seconds(st.get('p50'))}"
            f" p90 {seconds(st.get('p90'))} p99 {seconds(st.get('p99'))} | peak {label} {gib(peak)}"
        )

    def top_fix(self) -> tuple[Finding, Recommendation | None] | None:
        """The costliest finding above info and its first recommendation with an override (or None)."""
        for finding, recs in zip(self.findings, self.recommendations, strict=True):
            if finding.severity != "info":
                return finding, next((r for r in recs if r.override), None)
        return None

    def uncorroborated(self) -> tuple[Finding, Recommendation | None] | None:
        """The costliest info finding that is info only for want of a second source (one rank's profiler window:
        a one-GPU run has no other), when it would cost COST_WARNING or more: the verdict must not call that
        nothing."""
        for finding, recs in zip(self.findings, self.recommendations, strict=True):
            unsure = finding.evidence.get("corroborated") is False
            if finding.severity == "info" and unsure and (finding.cost_fraction or 0.0) >= COST_WARNING:
                return finding, next((r for r in recs if r.override), None)
        return None

    def verdict(self) -> str:
        """Where the step goes, and what the top fix is expected to buy."""
        shares = self.analysis.summary.step_shares
        split = "step split n/a (no step records)"
        if shares:
            shown = [f"{name} {pct(v, 0)}" for name, v in shares.items() if name != "waiting" or v >= 0.005]
            split = "step = " + ", ".join(shown)
            if (exchange := self.analysis.summary.all_to_all) is not None:
                split += (
                    f" (expert all-to-all {pct(exchange['share'], 0)} of the step: {pct(exchange['transfer'], 0)} "
                    f"transfer, {pct(exchange['waiting'], 0)} waiting)"
                )
        top = self.top_fix()
        if top is None and (unsure := self.uncorroborated()) is not None:
            finding, rec = unsure
            cost = pct(finding.cost_fraction, 0)
            lead = f"{split}; {finding.kind} may cost {cost} but rests on one source only (info)"
            return lead + (f": `diagnose --ab` with {rec.override} measures it" if rec else "")
        if top is None:
            return f"{split}; nothing costs {pct(COST_WARNING, 0)} of the step or more: no fix worth making"
        finding, rec = top
        if finding.kind == "crash":
            return f"{split}; the run crashed: {finding.message}"
        if ended_run(finding):
            return f"{split}; {finding.message}" + (f"; try {rec.override} (not measured)" if rec else "")
        lead = f"{split}; top: {finding.kind} costs {pct(finding.cost_fraction, 0)}"
        if rec is None:
            return f"{lead} (no config lever: see report)"
        if not rec.ab_testable:
            return f"{lead}; try {rec.override} (not measured)"
        if not rec.gain_estimated:
            return f"{lead}; try {rec.override} (saving not estimated: `diagnose --ab` measures it)"
        saved = pct(rec.expected_gain["fraction"], 0)
        return f"{lead}, {rec.override} expected to save ~{saved} of {scale_of_rec(rec)}"

    def text_summary(self) -> str:
        """A few lines for the end of a run: the verdict, headline numbers, findings with their first override."""
        lines = [f"diagnostics: {self.verdict()}", f"  {self.headline()}"]
        pairs = list(zip(self.findings, self.recommendations, strict=True))
        for finding, recs in pairs[:TEXT_FINDINGS]:
            # A crash or a non-finite stop does not slow steps down: it ends the run.
            scale = "step" if scale_of(finding.kind) == "the step" else scale_of(finding.kind)
            price = "[run stopped]" if ended_run(finding) else f"[{pct(finding.cost_fraction, 0)} of {scale}]"
            lines.append(f"  {finding.severity:<8} {finding.kind} {price}: {finding.message}{self.next_step(recs)}")
        if len(pairs) > TEXT_FINDINGS:
            lines.append(f"  ... and {len(pairs) - TEXT_FINDINGS} more findings in the report")
        if (tail := tail_line(self.analysis.summary.tail)) is not None:
            lines.append(f"  {tail}")
        prediction = self.prediction
        if prediction is not None:
            lines.append(f"  {one_line(prediction)}")
        if self.analysis.run.problems:
            lines.append(f"  {len(self.analysis.run.problems)} telemetry problem(s) noted in the report")
        if self.verdicts:
            lines.append(f"  A/B verdicts: {self.run_dir / AB_DIR / VERDICT_MD}")
        if self.written_to is not None:
            lines.append(f"report: {self.written_to / 'report.html'} (also report.md, report.json)")
        return "\n".join(lines)
