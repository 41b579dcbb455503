"""The run's headline numbers (throughput, MFU/HFU, step-time percentiles, peak memory) and per-rank phases."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from itertools import pairwise
from typing import Any

from diagnostics.analysis.load import RankTelemetry, RunTelemetry, StepRecord, num
from diagnostics.analysis.pauses import loop_time
from diagnostics.analysis.phase_comm import TimedComm, timed_comm
from diagnostics.analysis.stats import mean, median, percentile, present, steady
from diagnostics.mfu import AccountingError, checked_utilization, flops_utilization

PHASES = ("data_wait_s", "forward_s", "backward_s", "optimizer_s", "comm_wait_s")
MEMORY_KEYS = (
    "peak_allocated_bytes", "peak_reserved_bytes", "peak_rss_bytes", "device_memory_bytes", "training_state_bytes",
)  # fmt: skip


@dataclass(frozen=True)
class RankPhases:
    """Mean seconds per steady step of one rank, plus its profile split and memory peaks."""

    rank: int
    hostname: str | None
    steps: int
    step_s: float | None
    data_wait_s: float | None
    forward_s: float | None
    backward_s: float | None
    optimizer_s: float | None
    local_compute_s: float | None
    comm_wait_s: float | None
    backward_compute_s: float | None  # backward without the wait for communication at its end
    other_s: float | None  # step time no phase accounts for (hooks, logging, checkpoint writes, host overhead)
    other_median_s: float | None  # the typical step's share of it: one checkpoint write does not move it
    profile_total_s: float | None = None  # per profiled step
    profile_compute_s: float | None = None
    profile_comm_s: float | None = None
    profile_overlap_s: float | None = None
    profile_idle_s: float | None = None
    # Share of the profiled communication that is collectives: a pipeline stage's sends and receives are its
    # bubble (pipeline_bubble reports them), not communication to hide or shrink. 1.0 without pipelining.
    profile_collective_share: float = 1.0
    # Mean seconds per step this rank waited for a later rank inside collectives its phases issued (timed by the
    # collectors, analysis/phase_comm): part of what the profile counts as communication, but waiting.
    collective_wait_s: float | None = None
    peak_allocated_bytes: float | None = None
    peak_reserved_bytes: float | None = None
    peak_rss_bytes: float | None = None
    device_memory_bytes: float | None = None
    training_state_bytes: float | None = None


@dataclass
class Summary:
    world_size: int
    device: str  # gpu | cpu | unknown: what the samplers saw
    steps_recorded: int
    # Work per second over training steps only, in the run's ``work_unit`` (token, or sample for a LightningModule's
    # run, whose figure ``samples_per_s`` also holds); ``to_json`` keeps tokens_per_s only where tokens apply.
    tokens_per_s: float | None = None
    tokens_per_s_source: str | None = None
    work_unit: str = "token"
    samples_per_s: float | None = None
    tokens_per_sample: int | None = None  # a sample run whose module says what a token is: its tokens/s follow
    # The training loop's wall-clock time, its validation and checkpoint pauses, and the tokens per second it
    # delivers with them (analysis.pauses); None without timed step records.
    loop: dict[str, Any] | None = None
    mfu: float | None = None
    hfu: float | None = None
    peak_flops: float | None = None
    peak_flops_source: str | None = None
    calibrated_mfu: float | None = None
    calibrated_hfu: float | None = None
    calibrated_peak_flops: float | None = None
    flops_per_token: float | None = None
    hardware_flops_per_token: float | None = None
    step_time: dict[str, float | None] = field(default_factory=dict)
    peak_memory: dict[str, float | None] = field(default_factory=dict)
    accounting_errors: list[str] = field(default_factory=list)
    step_shares: dict[str, float] | None = None  # where the step goes (analysis.shares), filled by analyse()
    tail: dict[str, Any] | None = None  # the slow-step tail and what explains it (analysis.tail), filled by analyse()
    # Expert parallelism's all-to-alls: their share of the step, its transfer and waiting (analysis.phase_comm).
    all_to_all: dict[str, float] | None = None

    @property
    def rate_label(self) -> str:
        return "tokens/s" if self.work_unit == "token" else "samples/s"

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        if self.work_unit != "token":  # a sample run's rate is samples/s; it says so under its own name
            for key in ("tokens_per_s", "tokens_per_s_source", "flops_per_token", "hardware_flops_per_token"):
                out.pop(key)
            out["flops_per_sample"] = self.flops_per_token
            out["hardware_flops_per_sample"] = self.hardware_flops_per_token
            out["samples_per_s_source"] = self.tokens_per_s_source
            if self.tokens_per_sample and self.samples_per_s is not None:
                out["tokens_per_s"] = self.samples_per_s * self.tokens_per_sample
        return out


def _profile_means(tele: RankTelemetry) -> dict[str, float | None]:
    """Profile windows averaged per profiled step (windows of different lengths weigh by their steps)."""
    out: dict[str, float | None] = {}
    for key in ("total_s", "compute_s", "comm_s", "overlap_s", "idle_s"):
        values = [(getattr(p, key), p.steps or 1) for p in tele.profiles]
        out[f"profile_{key}"] = mean(v / steps for v, steps in values if v is not None)
    return out


def _collective_share(tele: RankTelemetry) -> float:
    if not tele.profiles or not any(s.bubble_fraction is not None for s in tele.steps):
        return 1.0
    by_op = tele.profiles[-1].comm_by_op or {}
    total = sum(by_op.values())
    p2p = sum(seconds for op, seconds in by_op.items() if "send" in op or "recv" in op)
    return 1.0 - p2p / total if total > 0 else 1.0


def unattributed_s(s: StepRecord) -> float | None:
    compute = s.local_compute_s
    if compute is None and s.forward_s is not None:
        compute = sum(present([s.forward_s, s.backward_s, s.optimizer_s]))
    if s.step_s is None or compute is None:
        return None
    return max(0.0, s.step_s - (s.data_wait_s or 0.0) - compute - (s.comm_wait_s or 0.0) - _bubble_s(s))


def _bubble_s(s: StepRecord) -> float:
    """Time a pipeline rank waited inside its schedule (explained by the schedule, not host overhead)."""
    return (s.bubble_fraction or 0.0) * (s.step_s or 0.0)


def rank_phases(tele: RankTelemetry) -> RankPhases:
    """Mean phases of one rank's steady steps.

    A DDP backward's wall time includes waiting for the last gradient buckets, which the step record also
    reports as ``comm_wait_s``; local compute (forward + backward compute + optimizer) excludes it. So the
    phases that add up to the step are data wait + local compute + comm wait, and the backward *compute* is
    local compute minus forward and optimizer.
    """
    steps = steady(tele.steps)
    means = {k: mean(getattr(s, k) for s in steps) for k in (*PHASES, "step_s", "local_compute_s")}
    compute = means["local_compute_s"]
    if compute is None and any(means[k] is not None for k in ("forward_s", "backward_s", "optimizer_s")):
        compute = sum(present(means[k] for k in ("forward_s", "backward_s", "optimizer_s")))
    backward = means["backward_s"]
    if means["local_compute_s"] is not None and means["forward_s"] is not None:
        backward = max(0.0, means["local_compute_s"] - means["forward_s"] - (means["optimizer_s"] or 0.0))
    bubble = mean(_bubble_s(s) for s in steps) if any(s.bubble_fraction is not None for s in steps) else None
    accounted = present([means["data_wait_s"], compute, means["comm_wait_s"], bubble])
    other = None
    if means["step_s"] is not None and accounted:
        other = max(0.0, means["step_s"] - sum(accounted))
    per_step = [unattributed_s(s) for s in steps]
    mem = tele.memory or {}
    return RankPhases(
        rank=tele.rank,
        hostname=(tele.meta or {}).get("hostname"),
        steps=len(steps),
        other_s=other,
        other_median_s=median(per_step),
        backward_compute_s=backward,
        profile_collective_share=_collective_share(tele),
        **means,
        **_profile_means(tele),
        **{k: num(mem.get(k)) for k in MEMORY_KEYS},
    )


def job_step_times(run: RunTelemetry) -> list[float]:
    """Per steady step, how far the job moved: the last rank's end of this step minus its end of the previous one.

    Where records carry start times. A rank held in its optimizer ends its step late and its peers wait for it
    in the next step's collective, so the slowest rank's own step time would count that hold twice (once in each
    step); the last rank's end moves by it once. Records without start times: the slowest rank's step time."""
    spans: dict[int, list[tuple[float, float]]] = {}  # step -> (start, end) per rank
    slowest: dict[int, float] = {}
    for tele in run.ranks.values():
        for s in steady(tele.steps):
            if s.step_s is None:
                continue
            slowest[s.step] = max(slowest.get(s.step, 0.0), s.step_s)
            if s.start_t:
                spans.setdefault(s.step, []).append((s.start_t, s.start_t + s.step_s))
    world = len(run.ranks)
    timed = sorted(step for step, e in spans.items() if len(e) == world)
    if world < 2 or len(timed) < len(slowest) or len(timed) < 2:
        return list(slowest.values())
    return [slowest[timed[0]]] + [
        job_step_moved(spans[b], max(end for _, end in spans[a])) for a, b in pairwise(timed) if b == a + 1
    ]


def job_step_moved(spans: list[tuple[float, float]], previous_end: float | None) -> float:
    """One step's progress of the job from its ranks' (start, end): the last end, from the previous step's last end
    or from the first start where every rank started later (a validation or checkpoint between the two steps)."""
    last_end = max(end for _, end in spans)
    if previous_end is None:
        return max(end - start for start, end in spans)
    return last_end - max(previous_end, min(start for start, _ in spans))


def run_device(run: RunTelemetry) -> str:
    """gpu | cpu | unknown. On a GPU the host's clocks time the launching of work, not the work: the rank's phases
    end when their kernels are queued, and the host waits for the device wherever it next synchronises."""
    sources = {s.source for tele in run.ranks.values() for s in tele.samples}
    if "nvml" in sources:
        return "gpu"
    device = str(run.meta("device") or "")
    if device.startswith("cuda") or device == "gpu":
        return "gpu"
    return "cpu" if "cpu" in sources or device == "cpu" else "unknown"


def _tokens_per_s(run: RunTelemetry, step_times: list[float]) -> tuple[float | None, str | None]:
    throughput = (run.ranks.get(0) or RankTelemetry(0)).throughput or {}
    if (value := num(throughput.get("tokens_per_s"))) is not None:
        return value, "throughput record"
    tokens_per_step = num(run.meta("tokens_per_step"))  # global tokens per optimizer step
    step_mean = mean(step_times)
    if tokens_per_step is not None and step_mean:
        return tokens_per_step / step_mean, "meta tokens_per_step / mean step time"
    # Step records carry the step's global tokens too: any one rank's records give the job's rate.
    for rank in sorted(run.ranks):
        steps = steady(run.ranks[rank].steps)
        tokens, seconds = sum(present(s.tokens for s in steps)), sum(present(s.step_s for s in steps))
        if tokens and seconds:
            return tokens / seconds, f"rank {rank} step tokens / step time"
    return None, None


def _samples_per_s(run: RunTelemetry, rate: float | None) -> float | None:
    """Samples per second: the rate itself in a sample run; a token run's tokens/s over its sequence length."""
    if rate is None or run.work_unit != "token":
        return rate
    seq_len = num(run.meta("seq_len"))
    return rate / seq_len if seq_len else None


def _utilizations(run: RunTelemetry, summary: Summary) -> None:
    """Fill MFU/HFU from the throughput record, else compute them; >100% becomes an accounting error."""
    rec = (run.ranks.get(0) or RankTelemetry(0)).throughput or {}
    recorded_flops = run.manifest.flops_per_token if run.manifest is not None else None
    counted = (run.ranks.get(0) or RankTelemetry(0)).flops_count or {}
    summary.flops_per_token = (
        num(run.meta("flops_per_token")) or num(counted.get("flops_per_unit")) or num(recorded_flops)
    )
    summary.hardware_flops_per_token = num(run.meta("hardware_flops_per_token")) or summary.flops_per_token
    summary.peak_flops = num(rec.get("peak_flops")) or num(run.meta("peak_flops"))
    summary.peak_flops_source = run.meta("peak_flops_source")
    calibrated = median(
        max(present(num(c.get("flops_per_s")) for c in tele.calibrations), default=None) for tele in run.ranks.values()
    )
    summary.calibrated_peak_flops = num(rec.get("calibrated_peak_flops")) or calibrated
    pairs = (
        ("mfu", summary.flops_per_token, summary.peak_flops),
        ("hfu", summary.hardware_flops_per_token, summary.peak_flops),
        ("calibrated_mfu", summary.flops_per_token, summary.calibrated_peak_flops),
        ("calibrated_hfu", summary.hardware_flops_per_token, summary.calibrated_peak_flops),
    )
    for name, flops, peak in pairs:
        label = name.replace("_", " ").upper().replace("CALIBRATED ", "calibrated ")
        try:
            if (value := num(rec.get(name))) is not None:
                setattr(summary, name, checked_utilization(value, label))
            elif summary.tokens_per_s and flops and peak:
                value = flops_utilization(summary.tokens_per_s, flops, summary.world_size, peak, label)
                setattr(summary, name, value)
        except AccountingError as err:
            summary.accounting_errors.append(str(err))


def _peak_memory(phases: list[RankPhases], run: RunTelemetry) -> dict[str, float | None]:
    def peak(key: str) -> float | None:
        return max(present(getattr(p, key) for p in phases), default=None)

    sampled = [s.mem_used_bytes for tele in run.ranks.values() for s in tele.samples if s.source == "nvml"]
    rss = [s.rss_bytes for tele in run.ranks.values() for s in tele.samples]
    return {
        "peak_allocated_bytes": peak("peak_allocated_bytes"),
        "peak_reserved_bytes": peak("peak_reserved_bytes"),
        "peak_rss_bytes": peak("peak_rss_bytes") or max(present(rss), default=None),
        "peak_sampled_device_bytes": max(present(sampled), default=None),
        "device_memory_bytes": peak("device_memory_bytes"),
    }


def with_collective_waits(phases: list[RankPhases], comm: TimedComm | None) -> list[RankPhases]:
    """The ranks' phases with their measured waiting inside timed collectives (``collective_wait_s``), which the
    profile's communication (transfer + waits) must not count as communication."""
    if comm is None:
        return phases
    return [replace(p, collective_wait_s=comm.wait_s.get(p.rank)) for p in phases]


def summarize(run: RunTelemetry) -> tuple[Summary, list[RankPhases]]:
    """Headline numbers and per-rank phase means of a loaded run."""
    comm = timed_comm(run)
    phases = with_collective_waits([rank_phases(run.ranks[r]) for r in sorted(run.ranks)], comm)
    step_times = job_step_times(run)
    summary = Summary(
        world_size=run.world_size,
        device=run_device(run),
        steps_recorded=max((len(t.steps) for t in run.ranks.values()), default=0),
        all_to_all=comm.all_to_all() if comm is not None else None,
    )
    summary.tokens_per_s, summary.tokens_per_s_source = _tokens_per_s(run, step_times)
    summary.work_unit = run.work_unit
    summary.samples_per_s = _samples_per_s(run, summary.tokens_per_s)
    tokens = run.meta("tokens_per_sample")
    summary.tokens_per_sample = tokens if isinstance(tokens, int) and summary.work_unit != "token" else None
    _utilizations(run, summary)
    summary.step_time = {
        "p50": percentile(step_times, 50),
        "p90": percentile(step_times, 90),
        "p99": percentile(step_times, 99),
        "mean": mean(step_times),
        "steps": len(step_times),
    }
    summary.peak_memory = _peak_memory(phases, run)
    loop = loop_time(run)
    summary.loop = loop.to_json() if loop is not None else None
    return summary, phases
