"""Everything a lent GPU is for, in one call that fits a short window, printing one table.

    python benchmarks/gpu_suite.py                      # all sections, within --budget-s (default 540 s)
    python benchmarks/gpu_suite.py --only runs tests    # some sections
    python benchmarks/gpu_suite.py --dry-run            # on CPU: every train command composes (dry_run=true),
                                                        # the benchmarks parse their arguments, pytest collects

Sections, in the order GPU time is best spent: ``kernels`` (this device's bf16 matmul rate, the LM head's GEMM at
the model's vocabulary and padded to a multiple of 64, which attention kernel SDPA picks), ``runs`` (gpt2-124m and
llama-1b, bf16 eager and compiled, fp8 tensorwise and rowwise: tokens/s, MFU against the datasheet, the planner's
step time and memory beside the measured ones, the report's findings, and where the profiled step's GPU time
went), ``overhead`` (``benchmarks/overhead.py`` and ``diagnostics_overhead.py`` on one GPU), ``tests``
(``pytest tests/gpu``). A section that the remaining budget cannot hold is skipped and says so.

The hw profile follows the device (an H100 runs as ``hw=8xh100``, an H200 as ``hw=8xh200``) with one device per
node. Results go to ``--out`` (results.json, one log per command) as well as the table.
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
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from diagnostics.collect.profile_window import events_from_trace  # noqa: E402

GIB = 2**30
# Benchmark runs keep no checkpoints (a llama-1b checkpoint with Adam's moments is ~15 GB) and validate only at
# the end; the token budget is the synthetic source's default.
COMMON = [
    "precision=bf16-mixed",
    "trainer.ckpt_every_n_steps=0",
    "trainer.val_every_n_steps=100000",
    "trainer.val_batches=2",
    "trainer.log_every_n_steps=20",
]


@dataclass(frozen=True)
class TrainRun:
    name: str
    overrides: list[str]
    steps: int
    estimate_s: float  # wall time on an H100/H200 with its start-up and compile, for the budget
    trace: bool = False  # summarise the profiled step's kernels


GPT2 = ["model=gpt2-124m", "trainer.micro_batch_size=16"]
LLAMA = ["model=llama-1b", "trainer.micro_batch_size=4"]
LLAMA8 = ["model=llama-1b", "trainer.micro_batch_size=8"]
EAGER = ["model.compile=false"]  # model.compile=null compiles on GPUs: the eager arm asks for it
FP8 = ["precision=fp8"]
RUNS = [
    TrainRun("gpt2-124m bf16", GPT2, 60, 50, trace=True),
    TrainRun("gpt2-124m bf16 eager", GPT2 + EAGER, 60, 40, trace=True),
    # Host-bound at micro 16 (the 2026-11-27 H200 window: 44% GPU busy): twice the work per launch.
    TrainRun("gpt2-124m bf16 micro 32", ["model=gpt2-124m", "trainer.micro_batch_size=32"], 60, 55, trace=True),
    # The default on one GPU under DDP records each compiled block as a CUDA graph; this is the compiled run
    # without them (what multi-GPU DDP and FSDP runs launch), kernel by kernel.
    TrainRun("gpt2-124m bf16 no cudagraphs", [*GPT2, "model.compile_mode=default"], 60, 50, trace=True),
    # 1-bit Adam's optimizer path on one GPU (compression with no one to exchange with): what it adds to the step
    # beside the row above's AdamW, compressing from step 20.
    TrainRun(
        "gpt2-124m bf16 onebit_adam",
        [*GPT2, "model.compile_mode=default", "optimizer=onebit_adam", "optimizer.freeze_steps=20"],
        60,
        50,
        trace=True,
    ),
    TrainRun("llama-1b bf16 eager", LLAMA + EAGER, 40, 60, trace=True),
    # 200 steps each: fp8's loss is compared with bf16's over the same 200 steps.
    TrainRun("llama-1b bf16", LLAMA, 200, 90, trace=True),
    TrainRun("llama-1b fp8 tensorwise", LLAMA + FP8, 200, 90, trace=True),
    TrainRun("llama-1b fp8 rowwise", [*LLAMA, *FP8, "precision.recipe=rowwise"], 60, 75),
    # Twice the tokens per step: the optimizer's fixed time per step (a sixth of it at micro 4) weighs half.
    TrainRun("llama-1b bf16 micro 8", LLAMA8, 60, 60, trace=True),
    TrainRun("llama-1b fp8 tensorwise micro 8", LLAMA8 + FP8, 60, 60, trace=True),
    # The LM head in fp8 too (a fifth of llama-1b's matmul FLOPs, bf16 by default): the next lever toward 1.2x bf16,
    # judged by the loss against bf16's over the same steps.
    TrainRun("llama-1b fp8 tensorwise micro 8 head", [*LLAMA8, *FP8, "precision.fp8_head=true"], 60, 60, trace=True),
    # fp8 records CUDA graphs by default on one GPU since 2026-11-30 (77.7k tokens/s, against 74.4k without them on
    # another day): the same window's counterpart without them.
    TrainRun(
        "llama-1b fp8 tensorwise micro 8 no cudagraphs",
        [*LLAMA8, *FP8, "model.compile_mode=default"],
        60,
        60,
        trace=True,
    ),
]
# fp8's final training loss may differ from bf16's by this much (nats) after 200 steps of the same data and seed.
FP8_LOSS_TOLERANCE = 0.05


@dataclass
class Suite:
    budget_s: float
    out: Path
    dry_run: bool
    hw: list[str]
    runs: list[str] = field(default_factory=list)  # names of RUNS to run (empty: all)
    benches: list[str] = field(default_factory=list)  # names of the overhead section's benchmarks (empty: all)
    tests: list[str] = field(default_factory=lambda: ["tests/gpu"])  # what the tests section hands pytest
    started: float = field(default_factory=time.monotonic)
    results: dict[str, Any] = field(default_factory=dict)

    def save(self) -> None:
        """results.json as it stands: a window cut short still returns what it measured."""
        (self.out / "results.json").write_text(json.dumps(self.results, indent=1, default=str))

    def left_s(self) -> float:
        return self.budget_s - (time.monotonic() - self.started)

    def fits(self, name: str, estimate_s: float) -> bool:
        if self.dry_run or self.left_s() >= estimate_s:
            return True
        self.results[name] = {"skipped": f"budget: {self.left_s():.0f} s left, needs ~{estimate_s:.0f} s"}
        print(f"[{name}] skipped: {self.results[name]['skipped']}", flush=True)
        return False

    def command(self, name: str, argv: list[str], timeout_s: float, cwd: Path | None = None) -> tuple[int, str]:
        """Run ``argv`` with its output in OUT/<name>.log; the exit code and the output's tail."""
        log = self.out / f"{slug(name)}.log"
        start = time.monotonic()
        try:
            proc = subprocess.run(
                argv,
                cwd=cwd or REPO,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                timeout=max(10.0, timeout_s),
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
            code, text = proc.returncode, proc.stdout
        except subprocess.TimeoutExpired as err:
            code, text = 124, (err.stdout or b"").decode() if isinstance(err.stdout, bytes) else (err.stdout or "")
        log.write_text(text)
        print(f"[{name}] exit {code} in {time.monotonic() - start:.0f} s", flush=True)
        return code, text[-3000:]


def slug(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name).strip("_")


def gpu_hw() -> list[str]:
    """The hw profile of the device this runs on, one device per node (a dry run composes for an H200)."""
    import torch

    name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "H200"
    profile = "8xh100" if "H100" in name else "8xh200"
    return [f"hw={profile}", "hw.devices_per_node=1"]


# -- kernels ----------------------------------------------------------------------------------------------------
def time_cuda(fn: Callable[[], object], repeats: int = 20) -> float:
    """Median seconds of ``fn`` on the GPU (events around each call, after warm-up)."""
    import torch

    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def kernel_probes() -> dict[str, Any]:
    """bf16 GEMM rate, the LM head's forward+backward GEMMs at gpt2's vocabulary vs padded to 64, SDPA's backend."""
    import torch
    import torch.nn.functional as F

    dev = torch.device("cuda")
    n = 8192
    a, b = torch.randn(n, n, device=dev, dtype=torch.bfloat16), torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    out: dict[str, Any] = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    out["cuda"] = torch.version.cuda
    out["bf16_matmul_tflops"] = 2 * n**3 / time_cuda(lambda: a @ b) / 1e12
    tokens, width = 16 * 1024, 768
    for vocab in (50257, 50304):
        x = torch.randn(tokens, width, device=dev, dtype=torch.bfloat16, requires_grad=True)
        w = torch.randn(vocab, width, device=dev, dtype=torch.bfloat16, requires_grad=True)

        def head(x: torch.Tensor = x, w: torch.Tensor = w) -> None:
            (x @ w.t()).sum().backward()

        seconds = time_cuda(head, repeats=10)
        out[f"lm_head_fwd_bwd_ms_vocab{vocab}"] = 1e3 * seconds
        out[f"lm_head_tflops_vocab{vocab}"] = 6 * tokens * width * vocab / seconds / 1e12
    q = torch.randn(16, 12, 1024, 64, device=dev, dtype=torch.bfloat16)
    backends = {}
    from torch.nn.attention import SDPBackend, sdpa_kernel

    for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
        try:
            with sdpa_kernel(backend):
                backends[backend.name] = 1e3 * time_cuda(
                    lambda: F.scaled_dot_product_attention(q, q, q, is_causal=True)
                )
        except RuntimeError as err:
            backends[backend.name] = f"unavailable: {str(err)[:80]}"
    backends["default"] = 1e3 * time_cuda(lambda: F.scaled_dot_product_attention(q, q, q, is_causal=True))
    out["sdpa_fwd_ms_16x12x1024x64"] = backends
    return out


# -- runs -------------------------------------------------------------------------------------------------------
KERNEL_CLASSES = (
    ("comm", ("nccl",)),
    ("attention", ("flash", "fmha", "attention", "cudnn_generated", "sdpa")),
    ("matmul", ("gemm", "sm90_xmma", "cutlass", "nvjet", "cublas", "scaled_mm", "_mm_")),
    ("optimizer", ("adam", "multi_tensor")),
    ("compiled (triton)", ("triton",)),
    ("memcpy/memset", ("memcpy", "memset", "Memcpy", "Memset")),
)


def kernel_class(name: str) -> str:
    low = name.lower()
    for label, needles in KERNEL_CLASSES:
        if any(n.lower() in low for n in needles):
            return label
    return "elementwise/other"


def kernel_label(name: str) -> str:
    """A kernel's name short enough for the table, its functor kept (ATen's elementwise kernels differ only there)."""
    for noise in ("void ", "at::native::", "(anonymous namespace)::", "at::detail::", "std::"):
        name = name.replace(noise, "")
    return name[:160]


def trace_summary(trace_file: Path) -> dict[str, Any]:
    """Where the profiled steps' GPU time went: busy share of the window and kernel time by class, top kernels."""
    events, (start, end) = events_from_trace(json.loads(trace_file.read_text()))
    kernels = sorted((e for e in events if e.on_device), key=lambda e: e.start_s)
    span = max(end - start, 1e-9)
    busy, cursor = 0.0, start
    for e in kernels:  # union of kernel intervals (streams may overlap)
        lo, hi = max(e.start_s, cursor), min(e.end_s, end)
        if hi > lo:
            busy += hi - lo
            cursor = hi
    by_class: dict[str, float] = {}
    by_name: dict[str, float] = {}
    for e in kernels:
        seconds = e.end_s - e.start_s
        by_class[kernel_class(e.name)] = by_class.get(kernel_class(e.name), 0.0) + seconds
        name = kernel_label(e.name)
        by_name[name] = by_name.get(name, 0.0) + seconds
    total = sum(by_class.values()) or 1e-9
    return {
        "window_s": span,
        "gpu_busy_share": busy / span,
        "by_class_share": {k: round(v / total, 3) for k, v in sorted(by_class.items(), key=lambda kv: -kv[1])},
        "top_kernels_ms": {k: round(1e3 * v, 2) for k, v in sorted(by_name.items(), key=lambda kv: -kv[1])[:16]},
        "kernels": len(kernels),
    }


SLOW_STEP_PHASES = ("forward_s", "backward_s", "optimizer_s", "other_s", "data_wait_s")


def slowest_steps(telemetry: Path, count: int = 5) -> list[dict[str, Any]]:
    """Rank 0's slowest steps with their phases in ms: where a short run's one-off costs sit (the 2026-11-30 window:
    a first logging step of 396 ms, 349 of it in the optimizer phase, on a GPU only)."""
    if not telemetry.is_file():
        return []
    steps = [r for line in telemetry.read_text().splitlines() if (r := json.loads(line)).get("kind") == "step"]
    slow = sorted(steps, key=lambda r: -r["step_s"])[:count]
    return [
        {"step": r["step"], "ms": round(1e3 * r["step_s"], 1)}
        | {k.removesuffix("_s"): round(1e3 * r[k], 1) for k in SLOW_STEP_PHASES if r.get(k) is not None}
        for r in slow
    ]


def run_figures(run_dir: Path, trace: bool) -> dict[str, Any]:
    """Throughput, MFU, planner error and findings of a finished run, from its run.json and report.json."""
    manifest = json.loads((run_dir / "run.json").read_text())
    report = json.loads((run_dir / "report" / "report.json").read_text())
    summary = report.get("summary", {})
    prediction = manifest.get("prediction") or {}
    predicted = prediction.get("predicted", {})
    peak = (summary.get("peak_memory") or {}).get("peak_allocated_bytes")
    p50 = (summary.get("step_time") or {}).get("p50")
    figures: dict[str, Any] = {
        "status": manifest.get("status"),
        "tokens_per_s": summary.get("tokens_per_s"),
        "step_p50_ms": 1e3 * p50 if p50 else None,
        "mfu": summary.get("mfu"),
        "hfu": summary.get("hfu"),
        "final_train_loss": (manifest.get("result") or {}).get("train_loss"),
        "final_val_loss": (manifest.get("result") or {}).get("val_loss"),
        "predicted_step_ms": 1e3 * predicted["step_time_s"] if "step_time_s" in predicted else None,
        "datasheet_step_ms": 1e3 * prediction["datasheet"]["step_time_s"] if "datasheet" in prediction else None,
        "predicted_memory_gib": predicted.get("memory_bytes", 0) / GIB or None,
        "peak_allocated_gib": peak / GIB if peak else None,
        "findings": [
            f"{f['severity']} {f['kind']} {100 * (f.get('cost') or {}).get('fraction', 0):.0f}%"
            if isinstance(f.get("cost"), dict)
            else f"{f['severity']} {f['kind']}"
            for f in report.get("findings", [])
        ],
    }
    calibration = run_dir / "calibration.json"
    if calibration.is_file():  # the parts the planner composed its step and memory from
        figures["parts"] = json.loads(calibration.read_text()).get("parts")
    figures["slowest_steps"] = slowest_steps(run_dir / "telemetry" / "rank0000.jsonl")
    if figures["predicted_step_ms"] and figures["step_p50_ms"]:
        figures["planner_step_error"] = figures["predicted_step_ms"] / figures["step_p50_ms"] - 1
    if figures["predicted_memory_gib"] and figures["peak_allocated_gib"]:
        figures["planner_memory_error"] = figures["predicted_memory_gib"] / figures["peak_allocated_gib"] - 1
    traces = sorted((run_dir / "traces").glob("*.json")) if trace else []
    if traces:
        try:
            figures["profile"] = trace_summary(traces[0])
        except (RuntimeError, ValueError, OSError) as err:
            figures["profile"] = f"unreadable: {err}"
    return figures


def train_runs(suite: Suite) -> None:
    for run in RUNS:
        if suite.runs and run.name not in suite.runs:
            continue
        if not suite.fits(run.name, run.estimate_s):
            continue
        overrides = [*COMMON, *suite.hw, *run.overrides, f"trainer.max_steps={run.steps}"]
        with tempfile.TemporaryDirectory() as tmp:
            run_dir = Path(tmp) / "run"
            argv = [sys.executable, "-m", "train", *overrides, f"hydra.run.dir={run_dir}"]
            if suite.dry_run:
                argv.append("dry_run=true")
            code, tail = suite.command(run.name, argv, timeout_s=max(suite.left_s(), 60), cwd=Path(tmp))
            entry: dict[str, Any] = {"overrides": overrides, "exit": code}
            if code == 0 and not suite.dry_run:
                try:
                    entry.update(run_figures(run_dir, run.trace))
                except (OSError, KeyError, ValueError) as err:
                    entry["error"] = f"figures unreadable: {err}"
            elif code != 0:
                entry["tail"] = tail
            suite.results[run.name] = entry
        suite.save()
        print(json.dumps({run.name: entry}, default=str)[:1500], flush=True)
    paired_runs(suite)


def paired_runs(suite: Suite) -> None:
    """Pairs on the same steps (fp8 against bf16, graphs against none): tokens/s ratio of the second to the first,
    and the final loss difference."""
    for bf16_name, fp8_name in (
        ("llama-1b bf16", "llama-1b fp8 tensorwise"),
        ("llama-1b bf16 micro 8", "llama-1b fp8 tensorwise micro 8"),
        ("llama-1b bf16 micro 8", "llama-1b fp8 tensorwise micro 8 head"),
        ("llama-1b fp8 tensorwise micro 8 no cudagraphs", "llama-1b fp8 tensorwise micro 8"),
    ):
        bf16, fp8 = suite.results.get(bf16_name, {}), suite.results.get(fp8_name, {})
        if not bf16.get("tokens_per_s") or not fp8.get("tokens_per_s"):
            continue
        entry: dict[str, Any] = {"speedup": fp8["tokens_per_s"] / bf16["tokens_per_s"]}
        if bf16.get("final_train_loss") is not None and fp8.get("final_train_loss") is not None:
            difference = fp8["final_train_loss"] - bf16["final_train_loss"]
            entry.update(loss_difference=difference, within_tolerance=abs(difference) <= FP8_LOSS_TOLERANCE)
        suite.results[f"{fp8_name} vs {bf16_name}"] = {**entry, "tolerance": FP8_LOSS_TOLERANCE}


# -- overhead and tests -------------------------------------------------------------------------------------------
# The overhead section's benchmarks: their arguments and estimated seconds on an H100/H200.
OVERHEAD_BENCHES = {
    # 300 steps: a 60-step run's whole-run ratio is mostly one-off costs (the profiler window, the first log step).
    "overhead.py": ([str(REPO / "benchmarks/overhead.py"), "--strategies", "ddp", "--repeats", "1"], 210),
    "diagnostics_overhead.py": ([str(REPO / "benchmarks/diagnostics_overhead.py"), "--repeats", "1"], 200),
}


def overhead(suite: Suite) -> None:
    extra = ["--extra", *suite.hw, *COMMON, *GPT2]
    for name, (args, estimate) in OVERHEAD_BENCHES.items():
        if suite.benches and name not in suite.benches:
            continue
        if not suite.fits(name, estimate):
            continue
        argv = [sys.executable, *args, "--steps", "300", *extra]
        if suite.dry_run:
            argv = [sys.executable, args[0], "--help"]
        code, tail = suite.command(name, argv, timeout_s=suite.left_s())
        suite.results[name] = {"exit": code, "tail": tail[-1500:]}
        suite.save()


TESTS_CAP_S = 240


def gpu_tests(suite: Suite) -> None:
    if not suite.fits("tests/gpu", 150):
        return
    argv = [sys.executable, "-m", "pytest", *suite.tests, "-p", "no:cacheprovider"]
    argv += ["-q", "--collect-only"] if suite.dry_run else ["-n", "8", "-v", "--durations=20"]
    # At most TESTS_CAP_S: a hung test must not take the window's other sections with it.
    code, tail = suite.command("tests/gpu", argv, timeout_s=min(suite.left_s(), TESTS_CAP_S))
    suite.results["tests/gpu"] = {"exit": code, "tail": tail[-1500:]}


SECTIONS: dict[str, Callable[[Suite], None]] = {
    "kernels": lambda s: s.results.update(kernels=kernel_probes()) if not s.dry_run else None,
    "runs": train_runs,
    "overhead": overhead,
    "tests": gpu_tests,
}


# -- table ------------------------------------------------------------------------------------------------------
def pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:+.0f}%"


def table(results: dict[str, Any]) -> str:
    rows = [
        "| run | tokens/s | step p50 | MFU (datasheet) | planner step (error) | memory predicted / peak (error) |"
        " GPU busy | top findings |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for run in RUNS:
        r = results.get(run.name)
        if not r or "tokens_per_s" not in r:
            rows.append(f"| {run.name} | {(r or {}).get('skipped') or (r or {}).get('exit', 'not run')} |||||||")
            continue
        profile = r.get("profile") if isinstance(r.get("profile"), dict) else {}
        rows.append(
            f"| {run.name} | {r['tokens_per_s']:,.0f} | {r['step_p50_ms'] or 0:.1f} ms | "
            f"{100 * (r['mfu'] or 0):.1f}% | {r['predicted_step_ms'] or 0:.1f} ms ({pct(r.get('planner_step_error'))})"
            f" | {r['predicted_memory_gib'] or 0:.2f} / {r['peak_allocated_gib'] or 0:.2f} GiB "
            f"({pct(r.get('planner_memory_error'))}) | {100 * profile.get('gpu_busy_share', 0):.0f}% | "
            f"{'; '.join(r['findings'][:3]) or 'none'} |"
        )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", choices=list(SECTIONS), default=list(SECTIONS))
    parser.add_argument("--budget-s", type=float, default=540.0)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu_suite_out")))
    parser.add_argument("--dry-run", action="store_true", help="compose and collect only (runs on CPU)")
    parser.add_argument("--runs", nargs="+", default=[], choices=[r.name for r in RUNS], metavar="NAME")
    parser.add_argument("--benches", nargs="+", default=[], choices=list(OVERHEAD_BENCHES), metavar="NAME")
    parser.add_argument("--tests", nargs="+", default=["tests/gpu"], help="pytest paths/node ids (tests section)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    suite = Suite(args.budget_s, args.out, args.dry_run, gpu_hw(), args.runs, args.benches, args.tests)
    for name in args.only:
        try:
            SECTIONS[name](suite)
        except Exception as err:  # one broken section must not cost the rest of the window
            suite.results[f"{name} (error)"] = f"{type(err).__name__}: {err}"
            print(f"[{name}] failed: {type(err).__name__}: {err}", flush=True)
    suite.save()
    print(json.dumps({k: v for k, v in suite.results.items() if k not in {r.name for r in RUNS}}, indent=1)[:4000])
    print(table(suite.results))
    failed = [k for k, v in suite.results.items() if isinstance(v, dict) and v.get("exit") not in (None, 0)]
    print(f"suite: {len(failed)} failed command(s){': ' + ', '.join(failed) if failed else ''}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
