"""``python -m diagnose``: rebuild a run's bottleneck report from its telemetry, A/B its fixes, compare runs.

    python -m diagnose RUN_DIR               report/ from RUN_DIR/telemetry, then the short summary
    python -m diagnose RUN_DIR --ab [--run]  the A/B multirun command(s) for the top recommendations (and run them)
    python -m diagnose compare RUN_A RUN_B   config diff, metric deltas, findings gone/new, and why
    python -m diagnose sweep MULTIRUN_DIR    every run of a sweep compared: MULTIRUN_DIR/report/sweep.{md,html,json}

Pure Python over the run directory (no torch): works on a laptop over a directory copied from a cluster.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
from pathlib import Path

from diagnostics.crash import read_crash_records
from diagnostics.recommend import ab_tests
from diagnostics.report import AB_TOP_K, Report, build_report, diagnose_run
from diagnostics.report.compare import compare_reports
from diagnostics.telemetry import TELEMETRY_DIR
from disttrain.config.errors import USER_ERROR_EXIT_CODE  # torch-free: the CLI stays laptop-friendly


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
    if not (args.ab or args.run):
        # The function the end of a training run writes its report with: both give the same report.
        print(diagnose_run(checked_run_dir(args.run_dir)).text_summary())
        return 0
    report = load_report(args.run_dir)
    tests = ab_tests(report.analysis, report.recommendations, args.top_k)
    if not tests:
        print("# no recommendation with a config override to A/B-test")
        return 0
    print("\n".join(t.shell() for t in tests))
    if not args.run:
        return 0
    status = 0
    for test in tests:
        # One sweep at a time: each job uses the whole machine, and parallel sweeps would skew the comparison.
        command = [sys.executable, "-m", "train", *test.argv]
        print(f"\n$ {shlex.join(command)}", flush=True)
        code = subprocess.run(command, check=False).returncode
        status = status or code
    return status


def compare_command(args: argparse.Namespace) -> int:
    a, b = load_report(args.run_a), load_report(args.run_b)
    print(compare_reports(a, b).text())
    return 0


def sweep_command(args: argparse.Namespace) -> int:
    from diagnostics.report.sweep import build_sweep_report, write_sweep_report

    path = Path(args.sweep_dir)
    if not path.is_dir():
        raise UserError(f"'{args.sweep_dir}' is not a directory; pass a multirun dir (multirun/<date>/<time>)")
    try:
        report = build_sweep_report(path)
    except FileNotFoundError as err:
        raise UserError(f"{err}; pass the directory of a python -m train -m sweep (multirun/<date>/<time>)") from None
    write_sweep_report(report)
    print(report.text_summary())
    return 0


def _report_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="diagnose",
        description="Rebuild RUN_DIR/report/ from RUN_DIR/telemetry and print the bottleneck summary.",
        epilog="Compare two runs: python -m diagnose compare RUN_A RUN_B; a whole sweep: python -m diagnose sweep DIR",
    )
    parser.add_argument("run_dir", help="a training run directory (holds telemetry/ and run.json)")
    parser.add_argument("--ab", action="store_true", help="print the Hydra multirun A/B command per top recommendation")
    parser.add_argument("--run", action="store_true", help="with --ab: launch those multiruns (python -m train -m ...)")
    parser.add_argument("--top-k", type=int, default=AB_TOP_K, help="how many recommendations to A/B (default 3)")
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
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        if argv[:1] == ["compare"]:
            return compare_command(_compare_parser().parse_args(argv[1:]))
        if argv[:1] == ["sweep"]:
            return sweep_command(_sweep_parser().parse_args(argv[1:]))
        return report_command(_report_parser().parse_args(argv))
    except UserError as err:
        print(f"diagnose: error: {err}", file=sys.stderr)
        return USER_ERROR_EXIT_CODE


if __name__ == "__main__":
    sys.exit(main())
