"""The tune loop: diagnose the current best config, A/B its best candidate lever against it with the existing
interleaved protocol (``diagnostics.ab.run_ab``), keep it if the rules say so, and repeat.

A kept lever's own A/B runs are runs of the new config with full telemetry: the next round is diagnosed from
one of them instead of from an extra run. Every test goes to the advice ledger, as ``diagnose --ab --run``'s do.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path

from diagnostics.ab import ledger
from diagnostics.ab.runner import AbSet, Arm, Launcher, RunOutcome, launch_train, run_ab
from diagnostics.ab.verdict import VERDICT_JSON, VERDICT_MD, set_verdict, to_markdown
from diagnostics.files import write_text_atomic
from diagnostics.report import Report, build_report
from disttrain.tune.experiment import experiment_yaml
from disttrain.tune.levers import key_of
from disttrain.tune.losses import read_losses
from disttrain.tune.rules import (
    Candidate,
    Skipped,
    candidates,
    carried_over,
    decide,
    inconclusive_reason,
    loss_gap,
    repeats_that_fit,
    retarget,
    retry_rounds,
    stop_reason,
    unsettled,
)
from disttrain.tune.settings import TuneSettings
from disttrain.tune.summary import Row, TuneSummary, table_header, table_row

BASE_DIR = "round0"  # the starting config's own run: its diagnosis is round 1's
EXPERIMENT_FILE = "tuned.yaml"
CHECKPOINTS_OFF = "trainer.ckpt_every_n_steps=0"  # measurement runs: nothing to resume, no time spent writing


def measurement_pins(overrides: list[str], steps: int) -> list[str]:
    """What every run of a tune adds to the user's overrides: its length, and no checkpoints unless asked for."""
    pins = [f"trainer.max_steps={steps}"]
    if not any(key_of(o) == "trainer.ckpt_every_n_steps" for o in overrides):
        pins.append(CHECKPOINTS_OFF)
    return pins


def _loss_pairs(ab: AbSet) -> list[tuple[dict[int, float], dict[int, float]]]:
    original, tested = ab.arms[0], ab.arms[1]
    return [
        (read_losses(original.rounds[r].run_dir), read_losses(tested.rounds[r].run_dir))
        for r in sorted(tested.rounds)
        if original.rounds[r].tokens_per_s is not None and tested.rounds[r].tokens_per_s is not None
    ]


def _next_diagnosis(ab: AbSet) -> tuple[RunOutcome, float]:
    """The kept arm's run to diagnose next (its median-throughput round: neither a lucky nor an unlucky one) and
    the median seconds one of its runs took."""
    done = [o for o in ab.arms[1].rounds.values() if o.tokens_per_s is not None]
    ranked = sorted(done, key=lambda o: o.tokens_per_s or 0.0)
    return ranked[len(ranked) // 2], statistics.median(o.seconds for o in done)


class Tuner:
    """One ``python -m tune``: state of the current best config and the rows of the table so far."""

    def __init__(
        self,
        overrides: list[str],
        settings: TuneSettings,
        tune_dir: Path,
        groups: set[str],
        launch: Launcher = launch_train,
        say: Callable[[str], None] = print,
    ) -> None:
        self.settings, self.tune_dir, self.groups, self.launch, self.say = settings, tune_dir, groups, launch, say
        self.pins = measurement_pins(overrides, settings.steps)
        self.current = [*overrides, *self.pins]
        self.summary = TuneSummary(tune_dir, list(overrides), asdict(settings) | {"output_dir": str(tune_dir)})
        self.started = time.monotonic()
        self.tried: set[str] = set()

    def remaining_s(self) -> float:
        return self.settings.budget_s - (time.monotonic() - self.started)

    def run(self) -> TuneSummary:
        self.tune_dir.mkdir(parents=True, exist_ok=True)
        base = self.launch(Arm("A", "start", tuple(self.current)), self.tune_dir / BASE_DIR)
        if base.tokens_per_s is None:
            self.summary.stop = "the starting config did not run"
            self.summary.error = base.error
            return self._finish()
        self.summary.start_tokens_per_s, self.summary.rate_label = base.tokens_per_s, base.rate_label
        rate = f"{base.tokens_per_s:,.0f} {base.rate_label}"
        self.say(f"tune: round 0 (start): {rate} [{base.seconds:.0f} s]; {base.run_dir}")
        report, run_s = build_report(base.run_dir), base.seconds
        speedup = 1.0
        earlier: list[Candidate] = []  # untested candidates of earlier diagnoses
        while True:
            found, skipped = candidates(
                report.analysis,
                report.recommendations,
                self.current,
                self.settings.allow,
                self.settings.min_cost,
                self.tried,
            )
            found += [retarget(c, self.current) for c in carried_over(found, earlier, self.tried)]
            earlier = found
            fit = repeats_that_fit(self.remaining_s(), run_s, self.settings.repeats, self.settings.max_repeats)
            costly = sum(f.cost_fraction >= self.settings.min_cost for f in report.findings)
            stop = stop_reason(
                costly, len(found), len(self.summary.rows), self.settings.max_rounds, fit, self.settings.min_cost
            )
            if stop is not None:
                self._explain(skipped, stop)
                break
            row, ab = self._test(found[0], self.settings.repeats, fit, speedup, report)
            if not row.kept and unsettled(row.verdict, row.resolved):
                row, ab = self._retry(found[0], row, ab, run_s, speedup, report)
            if row.kept:
                speedup = row.cumulative
                self.current = list(found[0].test.recommended)
                diagnosed, run_s = _next_diagnosis(ab)
                report = build_report(diagnosed.run_dir)
        return self._finish()

    def _retry(
        self, candidate: Candidate, first: Row, first_ab: AbSet, run_s: float, speedup: float, report: Report
    ) -> tuple[Row, AbSet]:
        """An unsettled A/B gets one retry with more rounds (at least one more than it had, up to twice as many) if
        an A/B test and the budget are left for it; a lever still unsettled after it, or without one, is dropped
        as inconclusive, with every round it had."""
        no_test_left = len(self.summary.rows) >= self.settings.max_rounds
        rounds = None if no_test_left else retry_rounds(first.pairs, self.remaining_s(), run_s)
        if rounds is None:
            why = (
                f"tune.max_rounds={self.settings.max_rounds} leaves no A/B test for a retry"
                if no_test_left
                else "the budget left cannot pay for a retry with more rounds"
            )
            return self._drop(candidate, first, first.pairs, why), first_ab
        ci = "" if first.ci is None else f" (95% CI {first.ci[0]:+.1%}..{first.ci[1]:+.1%})"
        self.say(
            f"tune: retrying {candidate.override}: inconclusive after {first.pairs} rounds{ci}; "
            f"{rounds[0]} to {rounds[1]} rounds this time"
        )
        row, ab = self._test(candidate, rounds[0], rounds[1], speedup, report, retry=True)
        if not row.kept and unsettled(row.verdict, row.resolved):
            return self._drop(candidate, row, first.pairs + row.pairs, "retried once with more rounds"), ab
        return row, ab

    def _drop(self, candidate: Candidate, row: Row, pairs: int, why: str) -> Row:
        """``row`` (the last of the lever's tests) with the reason it is dropped unsettled, noted for the summary."""
        reason = inconclusive_reason(pairs, row.ci, why)
        dropped = replace(row, reason=reason)
        self.summary.rows[-1] = dropped
        self.summary.inconclusive.append(
            {"finding": candidate.finding, "override": candidate.override, "reason": reason[len("not kept: ") :]}
        )
        return dropped

    def _test(
        self, candidate: Candidate, repeats: int, fit: int, speedup: float, report: Report, retry: bool = False
    ) -> tuple[Row, AbSet]:
        """One A/B of ``candidate`` against the current config (``repeats`` to ``fit`` rounds), its row printed and
        added to the summary, its test to the ledger."""
        round_no = len(self.summary.rows) + 1
        if round_no == 1:
            self.say(table_header())  # once, above the first A/B's lines
        set_dir = self.tune_dir / f"round{round_no}"
        set_dir.mkdir(parents=True, exist_ok=True)
        ab = run_ab(
            self.tune_dir,
            [candidate.test],
            repeats,
            fit,
            launch=self.launch,
            say=lambda line: self.say("  " + line),
            set_dir=set_dir,
        )
        verdict = set_verdict(ab, self.tune_dir)
        write_text_atomic(set_dir / VERDICT_JSON, json.dumps(verdict, indent=2) + "\n")
        write_text_atomic(set_dir / VERDICT_MD, to_markdown(verdict))
        (tested,) = verdict["recommendations"]
        gap = loss_gap(_loss_pairs(ab))
        decision = decide(tested["verdict"], candidate.lever, gap, self.settings.loss_tolerance)
        self.tried.add(candidate.override)
        context = ledger.context_json(report.analysis)
        record = ledger.entry(tested, candidate.finding, context, "tune", set_dir, candidate.finding_cost)
        ledger.append(
            ledger.output_root(self.tune_dir), [record | {"lever": candidate.lever.name, "kept": decision.keep}]
        )
        change = tested.get("change")
        row = Row(
            round_no,
            candidate.finding,
            candidate.override,
            candidate.lever.name,
            tested.get("expected_change"),
            change,
            tuple(tested["ci"]) if tested.get("ci") else None,
            int(tested.get("pairs") or 0),
            tested["verdict"],
            decision.keep,
            decision.reason,
            gap,
            speedup * (1.0 + change) if decision.keep and change is not None else speedup,
            set_dir.name,
            bool(tested.get("resolved")),
            retry,
        )
        self.summary.rows.append(row)
        self.say(table_row(row))
        return row, ab

    def _explain(self, skipped: list[Skipped], stop: str) -> None:
        self.summary.stop = stop
        self.summary.no_lever = [
            {"finding": s.finding, "ranks": list(s.ranks), "why": s.reason} for s in skipped if not s.override
        ]
        self.summary.skipped = [
            {"finding": s.finding, "override": s.override, "reason": s.reason} for s in skipped if s.override
        ]

    def _finish(self) -> TuneSummary:
        self.summary.final = [o for o in self.current if o not in self.pins]
        note = f"python -m tune: {self.tune_dir} (speed-up x{self.summary.speedup:.3f} measured)"
        text = experiment_yaml(self.summary.final, self.groups, note)
        if text is not None:
            out = self.tune_dir / "tune"
            out.mkdir(parents=True, exist_ok=True)
            write_text_atomic(out / EXPERIMENT_FILE, text)
            self.summary.experiment = f"tune/{EXPERIMENT_FILE}"
        self.summary.wall_s = time.monotonic() - self.started
        self.summary.write()
        for line in self.summary.closing_lines():
            self.say(line)
        return self.summary
