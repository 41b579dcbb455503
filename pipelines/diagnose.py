"""``python -m diagnose``: rebuild a run's bottleneck report from its telemetry, A/B its fixes, compare runs.

    python -m diagnose RUN_DIR               report/ from RUN_DIR/telemetry, then the short summary
    python -m diagnose RUN_DIR --ab [--run]  the A/B arms of the top recommendations (and run them: a verdict each)
    python -m diagnose compare RUN_A RUN_B   config diff, metric deltas, findings gone/new, and why
    python -m diagnose sweep MULTIRUN_DIR    every run of a sweep compared: MULTIRUN_DIR/report/sweep.{md,html,json}
    python -m diagnose advice [DIR]          how the tested recommendations' expected gains compared with measured ones

Pure Python over the run directory (no torch): works on a laptop over a directory copied from a cluster.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from diagnostics.ab import claim_set_dir, ledger, next_set_dir, plan_arms, run_ab, write_verdict
from diagnostics.ab.stats import METHOD
from diagnostics.ab.verdict import VERDICT_JSON, VERDICT_MD, text_table
from diagnostics.crash import read_crash_records
from diagnostics.recommend import AbTest, ab_tests
from diagnostics.report import AB_TOP_K, Report, build_report, diagnose_run, write_report
from diagnostics.report.compare import compare_reports
from diagnostics.report.sweep import build_sweep_report
from diagnostics.report.sweep_render import write_sweep_report
from diagnostics.telemetry import TELEMETRY_DIR
from disttrain.config.errors import USER_ERROR_EXIT_CODE  # torch-free: the CLI stays laptop-friendly

MIN_REPEATS = 3
# Enough rounds to resolve a 3% change when one pair of runs varies by ~3% (t-interval of 10 paired log ratios).
DEFAULT_MAX_REPEATS = 10


class UserError(Exception):
    """Bad input from the command line: printed as one line, exit code 2."""


def checked_run_dir(run_dir: str) -> Path:
    """``run_dir`` as a path, once it holds something to report on (telemetry, or a rank's crash record)."""
    path = Path(run_dir)
    if not path.exists():
        raise UserError(
            f"run directory '{run_dir}' does not exist; pass the run dir a training run printed at its end "
            "(e.g. outputs/<date>/<time>)"
        )
    if not path.is_dir():
        raise UserError(f"'{run_dir}' is a file, not a run directory; pass the directory that holds run.json")
    if not any((path / TELEMETRY_DIR).glob("rank*.jsonl")) and not read_crash_records(path):
        jobs = sorted(p.name for p in path.iterdir() if p.is_dir() and any((p / TELEMETRY_DIR).glob("rank*.jsonl")))
        if jobs:  # a Hydra multirun dir: its jobs are the runs
            raise UserError(
                f"'{run_dir}' is a multirun with jobs {jobs}: pass one job dir (e.g. {path / jobs[0]}), or compare "
                f"two with: python -m diagnose compare {path / jobs[0]} {path / jobs[-1]}"
            )
        raise UserError(
            f"'{run_dir}' has no telemetry ({path / TELEMETRY_DIR}/rank*.jsonl is missing): it ran with diagnostics "
            "off or died before its first step; train again with diagnostics on (the default) to get a report"
        )
    return path


def load_report(run_dir: str) -> Report:
    return build_report(checked_run_dir(run_dir))


def report_command(args: argparse.Namespace) -> int:
    _check_repeats(args)
    if not (args.ab or args.run):
        # The function the end of a training run writes its report with: both give the same report.
        print(diagnose_run(checked_run_dir(args.run_dir)).text_summary())
        return 0
    report = load_report(args.run_dir)
    tests = ab_tests(report.analysis, report.recommendations, args.top_k)
    if not tests:
        print("# no recommendation with a config override to A/B-test")
        return 0
    # A running A/B claims its set before saying where its runs go: another one started at once takes the next.
    set_dir = (claim_set_dir if args.run else next_set_dir)(report.run_dir).resolve()
    print(
        f"# A/B: arms interleaved per round ({' '.join(a.name for a in plan_arms(tests))}), {args.repeats} rounds, up "
        f"to {args.max_repeats} while a change is unresolved; run NN of arm X goes to {set_dir}/NN-X"
    )
    for arm in plan_arms(tests):
        print(f"# {arm.name}: {arm.label}\n{arm.shell(set_dir / f'01-{arm.name}')}")
    if not args.run:
        return 0
    ab = run_ab(report.run_dir, tests, args.repeats, args.max_repeats, set_dir=set_dir)
    verdict = write_verdict(ab, report.run_dir)
    record_advice(report, tests, verdict, ab.set_dir.name)
    # The original run's report now shows each tested recommendation with its verdict.
    write_report(build_report(report.run_dir))
    print(f"ab verdict after {ab.rounds} rounds ({ab.set_dir}); change: {METHOD}")
    print(text_table(verdict, ab.set_dir.name))
    ab_dir = ab.set_dir.parent
    print(f"verdict: {ab_dir / VERDICT_MD} (also {VERDICT_JSON}); report: {report.run_dir / 'report' / 'report.md'}")
    return 0


def record_advice(report: Report, tests: list[AbTest], verdict: dict[str, Any], set_name: str) -> None:
    """Append this set's tested recommendations to the advice ledger of the run's output root."""
    findings = {t.override: t.finding for t in tests}
    costs = {f.kind: f.cost_fraction for f in report.findings}
    context = ledger.context_json(report.analysis)
    entries = []
    for tested in (v for v in verdict["recommendations"] if v.get("set") == set_name):
        kind = findings.get(tested["override"])
        entries.append(ledger.entry(tested, kind, context, "diagnose --ab", report.run_dir, costs.get(kind or "")))
    path = ledger.append(ledger.output_root(report.run_dir), entries)
    print(f"advice ledger: {len(entries)} test(s) appended to {path} (python -m diagnose advice {path.parent})")


def _check_repeats(args: argparse.Namespace) -> None:
    if args.repeats is None and args.max_repeats is None:
        args.repeats, args.max_repeats = MIN_REPEATS, DEFAULT_MAX_REPEATS
        return
    if not (args.ab or args.run):
        raise UserError("--repeats and --max-repeats set the A/B runs: add --ab --run")
    args.repeats = MIN_REPEATS if args.repeats is None else args.repeats
    if args.repeats < MIN_REPEATS:
        raise UserError(
            f"--repeats {args.repeats} is too few: an interval from fewer than {MIN_REPEATS} paired rounds cannot "
            f"resolve a 3% change; pass --repeats {MIN_REPEATS} or more"
        )
    if args.max_repeats is None:
        args.max_repeats = max(DEFAULT_MAX_REPEATS, args.repeats)
    if args.max_repeats < args.repeats:
        raise UserError(
            f"--max-repeats {args.max_repeats} is below --repeats {args.repeats}; pass --max-repeats "
            f"{args.repeats} or more (equal: exactly {args.repeats} rounds)"
        )


def compare_command(args: argparse.Namespace) -> int:
    a, b = load_report(args.run_a), load_report(args.run_b)
    print(compare_reports(a, b).text())
    return 0


def sweep_command(args: argparse.Namespace) -> int:
    path = Path(args.sweep_dir)
    if not path.is_dir():
        raise UserError(f"'{args.sweep_dir}' is not a directory; pass a multirun dir (multirun/<date>/<time>)")
    try:
        report = build_sweep_report(path, args.storage)
    except FileNotFoundError as err:
        raise UserError(f"{err}; pass the directory of a python -m train -m sweep (multirun/<date>/<time>)") from None
    write_sweep_report(report)
    print(report.text_summary())
    return 0


def advice_command(args: argparse.Namespace) -> int:
    path = ledger.find_ledger(Path(args.dir))
    if path is None:
        raise UserError(
            f"no advice ledger ({ledger.LEDGER}) in '{args.dir}' or its output root; it is written by "
            "python -m diagnose RUN --ab --run and python -m tune: pass their output root (e.g. outputs)"
        )
    print(ledger.advice_text(ledger.read(path), path))
    return 0


def _advice_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="diagnose advice",
        description="Per finding kind: the tested recommendations' expected tokens/s change against the measured one.",
    )
    parser.add_argument(
        "dir", nargs="?", default="outputs", help="the output root holding advice_ledger.jsonl (default: outputs)"
    )
    return parser


def _report_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="diagnose",
        description="Rebuild RUN_DIR/report/ from RUN_DIR/telemetry and print the bottleneck summary.",
        epilog="Compare two runs: python -m diagnose compare RUN_A RUN_B; a whole sweep: python -m diagnose sweep DIR; "
        "how the tested advice scored: python -m diagnose advice [DIR]",
    )
    parser.add_argument("run_dir", help="a training run directory (holds telemetry/ and run.json)")
    parser.add_argument("--ab", action="store_true", help="print the A/B arms of the top recommendations")
    parser.add_argument(
        "--run", action="store_true", help="with --ab: run the arms interleaved and write RUN_DIR/ab/verdict.{md,json}"
    )
    parser.add_argument("--top-k", type=int, default=AB_TOP_K, help="how many recommendations to A/B (default 3)")
    parser.add_argument(
        "--repeats", type=int, help=f"rounds of every arm (at least and default {MIN_REPEATS})", metavar="N"
    )
    parser.add_argument(
        "--max-repeats",
        type=int,
        metavar="M",
        help=f"more rounds, up to M, while a change is unresolved (default {DEFAULT_MAX_REPEATS})",
    )
    return parser


def _compare_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="diagnose compare", description="What changed from RUN_A to RUN_B, and why.")
    parser.add_argument("run_a")
    parser.add_argument("run_b")
    return parser


def _sweep_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="diagnose sweep", description="Compare every run of a sweep: ranked table, Pareto front, scaling."
    )
    parser.add_argument("sweep_dir", help="a multirun directory (holds one run dir per job)")
    parser.add_argument(
        "--storage",
        default=None,
        help="the Optuna storage URL of a hydra/sweeper=optuna sweep whose study is on a server (default: the "
        "sweep dir's optuna.db, or the URL recorded in its optuna_study.json)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        if argv[:1] == ["compare"]:
            return compare_command(_compare_parser().parse_args(argv[1:]))
        if argv[:1] == ["sweep"]:
            return sweep_command(_sweep_parser().parse_args(argv[1:]))
        if argv[:1] == ["advice"]:
            return advice_command(_advice_parser().parse_args(argv[1:]))
        return report_command(_report_parser().parse_args(argv))
    except UserError as err:
        print(f"diagnose: error: {err}", file=sys.stderr)
        return USER_ERROR_EXIT_CODE


if __name__ == "__main__":
    sys.exit(main())
