"""Synthetic run directories for the analysis tests: telemetry written through the real TelemetryWriter.

Each scenario is a small set of knobs (phase times, a slow rank, memory, throttling, a hang) turned into the
records a collector would write; run.json and .hydra/overrides.yaml come from composing the real conf/ with
the scenario's overrides, so recommendations are checked against the project's actual config.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import random
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import OmegaConf

from diagnostics.crash import crash_path, write_crash_record
from diagnostics.telemetry import TelemetryWriter
from disttrain.config.parse import parse_run_config
from disttrain.strategies.layout import validate_run, world_layout
from tests.conftest import compose_train

GIB = 1024**3
GPU = ("hw=8xh100", "hw.devices_per_node=2")
T0 = 1_700_000_000.0  # a fixed start time keeps the fixtures reproducible


@dataclass(frozen=True)
class Scenario:
    overrides: tuple[str, ...] = ()
    steps: int = 20
    data_wait: float = 0.0005  # seconds per step (below the detectors' noise floor when healthy)
    forward: float = 0.10
    backward: float = 0.20
    optimizer: float = 0.02
    overhead: float = 0.002  # inside local compute but outside forward/backward/optimizer
    host_gap: float = 0.0  # Python/launch time inside forward during which no op runs (profiler idle)
    comm: float = 0.02  # true exposed communication per step, paid by every rank
    overlap: float = 0.7  # share of profiled communication hidden behind compute
    profile_comm: float = 0.05  # profiled communication per step (hidden + exposed)
    other: float = 0.001  # hooks and loop overhead between two steps (before the data fetch)
    slow_rank: int | None = None
    slow_factor: float = 1.0  # slow_rank's forward, backward and optimizer take this many times longer
    slow_phase: str | None = None  # or: slow_rank spends slow_s more in this phase (data|forward|...|other)
    slow_s: float = 0.0
    cpu_count: int | None = None  # of the host (None: unknown, as from an older collector); 1 thread per rank
    cpu_util: tuple[float, ...] | None = None  # each rank's CPU use (percent of a core) in its samples; None: 95-97
    data_cpu: float | None = None  # share of the data wait spent computing on the training thread (None: unrecorded)
    # Ranks also meet before forward, as DDP's buffer broadcast or FSDP's first all-gather makes them: a rank
    # that waits there for a slower one has the wait inside its forward time.
    sync_before_forward: bool = False
    # Ranks meet inside forward and inside backward too, as at FSDP2's per-block all-gathers: a rank that waits
    # there ends the phase with the slow one. ``timed_collectives``: the records carry that time inside forward and
    # backward (forward_comm_s, backward_comm_s) as the FSDP collector writes it; False: an older collector.
    sync_in_phases: bool = False
    # Ranks meet at the end of the optimizer step too, as ZeRO-3's step gathers and reduces: a rank that waits
    # there for a slower one ends its optimizer step with it (optimizer_comm_s holds that wait when timed).
    sync_in_optimizer: bool = False
    timed_collectives: bool = True
    # With sync_in_phases: each phase meets at this many collectives, recorded call by call (comm_calls_s). At each
    # call one rank arrives ``call_skew`` late (it computed that much longer before it) and the others wait for it:
    # ``late_rank`` always, or (None) the ranks in turn, as on a shared host. ``all_to_all``: the calls are an MoE
    # layer's all-to-alls (all_to_all_s, all_to_all_calls_s), and the profile sees them as gloo:all_to_all.
    phase_calls: int = 0
    call_skew: float = 0.0
    late_rank: int | None = None
    all_to_all: bool = False
    all_to_all_share: float = 1.0  # of each call's time; the rest is FSDP's all-gathers and reduce-scatters
    # Positions (in a step's calls) of the all-to-alls that end the experts' compute; at those rank 0 (holding the
    # busier experts) computed ``after_experts_skew`` longer and the others wait for it.
    after_experts: tuple[int, ...] = ()
    after_experts_skew: float = 0.0
    rank0_hold: tuple[int, float] | None = None  # (every, seconds): rank 0 is held between steps (writing logs)
    # (rank, every, phase, seconds): that rank (None: every rank) stalls that long in that phase every N-th step
    stall: tuple[int | None, int, str, float] | None = None
    comm_spike: tuple[int, float] | None = None  # (step, seconds): that step's collective is held this much longer
    skew: float = 0.0  # each step one rank, drawn at random, is held this long in forward (a shared host's scheduler)
    mfu: float = 0.35  # against the datasheet (GPU) or calibrated (CPU) peak
    mem_fraction: float = 0.45  # GPU reserved / device memory
    throttle_rank: int | None = None
    # The throttled device's reasons, and its power limits as NVML reports them (None: older telemetry without them).
    throttle_reasons: tuple[str, ...] = ("sw_thermal_slowdown", "hw_thermal_slowdown")
    power_limits_w: tuple[float, float] | None = None  # (enforced, default)
    bubble: float | None = None
    hang_after: int | None = None  # last completed step before every rank stops
    hang_loader_frames: tuple[str, ...] = ()  # where rank 1's DataLoader workers are when it hangs on them
    # (rank, step, phase): that rank raises in that step; the others' next collective fails ("closed by peer").
    crash: tuple[int, int, str] | None = None
    # Steps (the guard's numbering: the steps completed before it) with a non-finite ``nonfinite_what``; under
    # nan_policy=stop the first one ends the run, under skip each is skipped. Recorded by ``nonfinite_ranks``
    # (None: every rank, as the vote makes it).
    nonfinite: tuple[int, ...] = ()
    nonfinite_what: str = "loss and gradients"
    nan_policy: str = "stop"
    nonfinite_ranks: tuple[int, ...] | None = None
    nonfinite_manifest: bool = True  # run.json's nonfinite record, with the last good checkpoint of a stop
    jitter: float = 0.03
    comm_ops: tuple[str, ...] = ("gloo:all_reduce",)  # profiled communication, split evenly over these ops
    grad_hook: bool = True  # False: as under FSDP2, backward's communication wait is timed as compute
    config_patch: dict = field(default_factory=dict)  # written into run.json's config (e.g. hostile strings)
    # Mixture of experts: every rank routes its tokens over the experts in these shares (each layer alike); the
    # model's ep degree and experts come from the overrides; the routed experts make this share of the FLOPs.
    expert_shares: tuple[float, ...] | None = None
    expert_flops_share: float = 0.5
    expert_placement: tuple[int, ...] | None = None  # strategy.expert_placement, the same for every layer

    @property
    def gpu(self) -> bool:
        return any(o.startswith("hw=8xh100") for o in self.overrides)


SCENARIOS: dict[str, Scenario] = {
    "healthy": Scenario(),
    "input_bound": Scenario(data_wait=0.30),
    "straggler": Scenario(overrides=("hw.devices_per_node=4",), slow_rank=2, slow_factor=1.6),
    "comm_bound": Scenario(comm=0.40, profile_comm=0.42, overlap=0.05),
    "low_overlap": Scenario(comm=0.06, profile_comm=0.08, overlap=0.1),
    # Well overlapped, but the collectives take as long as the backward: no headroom (a WideModel-like run). Under
    # FSDP: DDP's exposure is its wait after backward, which the step records time every step.
    "comm_saturated": Scenario(overrides=("strategy=fsdp",), comm=0.03, profile_comm=0.22, overlap=0.9, cpu_count=2),
    "host_overhead": Scenario(host_gap=0.25),
    "throttled": Scenario(overrides=(*GPU, "precision=bf16-mixed"), throttle_rank=1),
    "memory_pressure": Scenario(overrides=(*GPU, "precision=bf16-mixed"), mem_fraction=0.985),
    "memory_pressure_fsdp": Scenario(overrides=(*GPU, "precision=bf16-mixed", "strategy=fsdp"), mem_fraction=0.93),
    "low_mfu": Scenario(overrides=GPU, mfu=0.05),
    "bubble": Scenario(bubble=0.35),
    # A 2-stage 1F1B pipeline with the fewest micro-batches: its p2p waits are bubble, not unhidden comm.
    "bubble_megatron": Scenario(
        overrides=("strategy=megatron", "strategy.pp=2", "trainer.micro_batch_size=8"),
        bubble=0.35,
        comm=0.0,
        profile_comm=0.1,
        overlap=0.05,
        comm_ops=("gloo:send", "gloo:recv"),
    ),
    # moe-micro under ep=2 on 2 ranks: expert 0 (on rank 0) gets 55% of the assignments, rank 0 70% of the load.
    "expert_imbalance": Scenario(
        overrides=("model=moe-micro", "strategy=fsdp", "strategy.ep=2", "trainer.ckpt_every_n_steps=0"),
        expert_shares=(0.55, 0.15, 0.15, 0.15),
    ),
    # moe-micro under ep=2, balanced: 5 all-to-alls per phase each moving little, at four of which one rank or the
    # other (in turn, as the shared host's scheduler has it) arrives 60 ms late. The profile sees the waits inside
    # gloo:all_to_all: waiting on peers, not communication.
    "moe_waits": Scenario(
        overrides=("model=moe-micro", "strategy=fsdp", "strategy.ep=2", "trainer.ckpt_every_n_steps=0"),
        expert_shares=(0.25, 0.25, 0.25, 0.25),
        sync_in_phases=True,
        phase_calls=5,
        call_skew=0.06,
        all_to_all=True,
        comm_ops=("gloo:all_to_all",),
        overlap=0.05,
        profile_comm=0.03,
    ),
    # The same MoE layout whose all-to-alls move much more than the compute can hide, no rank late: token traffic.
    "moe_comm_bound": Scenario(
        overrides=("model=moe-micro", "strategy=fsdp", "strategy.ep=2", "trainer.ckpt_every_n_steps=0"),
        expert_shares=(0.25, 0.25, 0.25, 0.25),
        sync_in_phases=True,
        phase_calls=5,
        all_to_all=True,
        comm_ops=("gloo:all_to_all",),
        comm=0.40,
        profile_comm=0.42,
        overlap=0.05,
    ),
    "hang": Scenario(hang_after=7),
    "crash": Scenario(crash=(1, 8, "forward")),
    "nonfinite_stop": Scenario(nonfinite=(12,)),
    "nonfinite_skip": Scenario(overrides=("trainer.nan_policy=skip",), nonfinite=(3, 9), nan_policy="skip"),
}


@functools.cache
def _manifest(overrides: tuple[str, ...]) -> dict:
    cfg = compose_train(list(overrides))
    run_cfg = parse_run_config(cfg)
    plan, layout = validate_run(run_cfg), world_layout(run_cfg)
    return {
        "status": "completed",
        "command": ["python", "pipelines/train.py", *overrides],
        "config": OmegaConf.to_container(cfg, resolve=True),
        "hw": dataclasses.asdict(run_cfg.hw),
        "world": dataclasses.asdict(layout),
        "batch": dataclasses.asdict(plan),
        "num_parameters": 1_828_992,
        "flops_per_token": 12_153_600.0,
    }


def _deep_update(target: dict, patch: dict) -> None:
    for key, value in patch.items():
        if isinstance(value, dict) and isinstance(target.get(key), dict):
            _deep_update(target[key], value)
        else:
            target[key] = value


def write_run(run_dir: Path, name: str, *, manifest: bool = True, **changes: object) -> Path:
    """Write the telemetry (+ run.json, .hydra/overrides.yaml) of scenario ``name`` into ``run_dir``."""
    sc = dataclasses.replace(SCENARIOS[name], **changes)
    man = json.loads(json.dumps(_manifest(sc.overrides)))
    _deep_update(man["config"], sc.config_patch)
    run_dir.mkdir(parents=True, exist_ok=True)
    if sc.nonfinite:
        _nonfinite_manifest(man, sc, run_dir)
    if manifest:
        (run_dir / "run.json").write_text(json.dumps(man, indent=2))
        (run_dir / ".hydra").mkdir(exist_ok=True)
        (run_dir / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in sc.overrides))
    _write_telemetry(run_dir, sc, man)
    return run_dir


def _stopped_at(sc: Scenario) -> int | None:
    return sc.nonfinite[0] if sc.nonfinite and sc.nan_policy == "stop" else None


def _nonfinite_manifest(man: dict, sc: Scenario, run_dir: Path) -> None:
    """run.json of a run with non-finite steps, as job/finish.py writes it."""
    stop = _stopped_at(sc)
    man["status"] = "stopped" if stop is not None else "completed"
    man["result"] = {"steps": stop + 1 if stop is not None else sc.steps}
    if not sc.nonfinite_manifest:
        return
    man["nonfinite"] = {
        "policy": sc.nan_policy,
        "skipped_steps": [] if stop is not None else list(sc.nonfinite),
        "stopped_at_step": stop,
        "stop_reason": None if stop is None else f"non-finite {sc.nonfinite_what} at step {stop} (nan_policy=stop)",
    }
    if stop is not None:
        last = run_dir / "checkpoints" / f"step{stop - stop % 5:06d}.ckpt"  # saved every 5 steps
        man["nonfinite"]["last_good_checkpoint"] = str(last)


@dataclass(frozen=True)
class RankStep:
    """One rank's step as the collector records it (seconds; start_t on the shared host clock)."""

    start_t: float
    step_s: float
    other: float
    data: float
    forward: float
    backward_compute: float
    comm_wait: float
    optimizer: float
    forward_comm: float = 0.0  # of forward: time inside collectives (FSDP2 all-gathers), waits included
    backward_comm: float = 0.0  # of backward compute, likewise
    optimizer_comm: float = 0.0  # of optimizer, likewise (ZeRO-3's step)
    calls: tuple[float, ...] = ()  # those collectives one by one, in order (Scenario.phase_calls)
    late_work: float = 0.0  # of forward and backward: the computing that made this rank late at some of them

    @property
    def local_compute(self) -> float:
        return self.forward + self.backward_compute + self.optimizer


def _timeline(sc: Scenario, world: int) -> list[list[RankStep]]:
    """Per step, per rank, a DDP-like step on one clock: ranks meet at the gradient all-reduce.

    Each rank starts when its previous step ended, runs other, data, forward and backward on its own, waits at
    the end of backward until the last rank arrives plus the true communication, then steps its optimizer. A
    slow rank's extra time therefore shows up as the others' comm wait (or, with ``grad_hook=False`` as under
    FSDP2, inside their backward).
    """
    rng = random.Random(1234)
    steps: list[list[RankStep]] = []
    start = [T0] * world
    completed = sc.steps if sc.hang_after is None else sc.hang_after
    if _stopped_at(sc) is not None:  # the stopping step completes (without its update), then the run ends
        completed = min(completed, _stopped_at(sc) + 1)
    for index in range(completed if sc.crash is None else sc.crash[1] - 1):
        rows = []
        for rank in range(world):
            slow = sc.slow_factor if rank == sc.slow_rank else 1.0
            extra = {sc.slow_phase: sc.slow_s} if rank == sc.slow_rank and sc.slow_phase else {}
            j = [1 + rng.uniform(-sc.jitter, sc.jitter) for _ in range(5)]
            seg = {
                "other": sc.other * j[4] + extra.get("other", 0.0),
                "data": sc.data_wait * j[3] + extra.get("data", 0.0),
                "forward": (sc.forward + sc.host_gap) * slow * j[0] + extra.get("forward", 0.0),
                "backward": sc.backward * slow * j[1] + sc.overhead + extra.get("backward", 0.0),
                "optimizer": sc.optimizer * slow * j[2] + extra.get("optimizer", 0.0),
            }
            rows.append(seg)
        if sc.skew:
            rows[rng.randrange(world)]["forward"] += sc.skew
        if sc.rank0_hold is not None and (index + 1) % sc.rank0_hold[0] == 0:
            rows[0]["other"] += sc.rank0_hold[1]
        if sc.stall is not None and (index + 1) % sc.stall[1] == 0:
            for rank in range(world) if sc.stall[0] is None else [sc.stall[0]]:
                rows[rank][sc.stall[2]] += sc.stall[3]
        if sc.sync_before_forward:
            ready = [start[r] + rows[r]["other"] + rows[r]["data"] for r in range(world)]
            for r in range(world):
                rows[r]["forward"] += max(ready) - ready[r]
        in_phase = {r: {"forward": 0.0, "backward": 0.0} for r in range(world)}
        calls: dict[int, list[float]] = {r: [] for r in range(world)}
        late_work = [0.0] * world
        if sc.sync_in_phases:  # a collective at the end of each phase's own work (the next block's all-gather)
            _skewed_calls(sc, world, rows, in_phase, calls, late_work, "forward")
            ready = [start[r] + rows[r]["other"] + rows[r]["data"] + rows[r]["forward"] for r in range(world)]
            for r in range(world):
                last_wait = max(ready) - ready[r] + sc.comm / 4
                in_phase[r]["forward"] += last_wait
                rows[r]["forward"] += last_wait
                calls[r].append(last_wait)
            _skewed_calls(sc, world, rows, in_phase, calls, late_work, "backward")
            ready = [start[r] + rows[r]["other"] + rows[r]["data"] + rows[r]["forward"] + rows[r]["backward"]
                     for r in range(world)]  # fmt: skip
            for r in range(world):
                last_wait = max(ready) - ready[r] + sc.comm / 4
                in_phase[r]["backward"] += last_wait
                rows[r]["backward"] += last_wait
                calls[r].append(last_wait)
        arrive = [start[r] + rows[r]["other"] + rows[r]["data"] + rows[r]["forward"] + rows[r]["backward"]
                  for r in range(world)]  # fmt: skip
        release = max(arrive) + sc.comm
        if sc.comm_spike is not None and sc.comm_spike[0] == index + 1:
            release += sc.comm_spike[1]
        in_optimizer = [0.0] * world
        if sc.sync_in_optimizer:
            done = max(seg["optimizer"] for seg in rows)
            in_optimizer = [done - seg["optimizer"] + sc.comm / 4 for seg in rows]
        step = []
        for rank, seg in enumerate(rows):
            optimizer = seg["optimizer"] + in_optimizer[rank]
            end = release + optimizer
            wait = release - arrive[rank]
            times = (seg["other"], seg["data"], seg["forward"], seg["backward"], wait, optimizer)
            comm = (in_phase[rank]["forward"], in_phase[rank]["backward"], in_optimizer[rank])
            step.append(RankStep(start[rank], end - start[rank], *times, *comm, tuple(calls[rank]), late_work[rank]))
            start[rank] = end
        steps.append(step)
    return steps


def _skewed_calls(
    sc: Scenario,
    world: int,
    rows: list[dict[str, float]],
    in_phase: dict[int, dict[str, float]],
    calls: dict[int, list[float]],
    late_work: list[float],
    phase: str,
) -> None:
    """A phase's collectives before its last one (Scenario.phase_calls - 1 of them): at each, one rank computed
    ``call_skew`` longer and arrives late, the others wait for it; each call moves ``comm / 4 / phase_calls``. Every
    rank's phase grows by the same total, so the calls change who waits where, not when the phase ends."""
    transfer = sc.comm / 4 / max(1, sc.phase_calls)
    for i in range(max(0, sc.phase_calls - 1)):
        late = sc.late_rank if sc.late_rank is not None else i % world
        hot = sc.after_experts_skew if len(calls[0]) in sc.after_experts else 0.0
        work = [sc.call_skew * (r == late) + hot * (r == 0) for r in range(world)]
        for r in range(world):
            wait = max(work) - work[r]  # the others arrive when the last one does
            rows[r][phase] += work[r] + wait + transfer
            late_work[r] += work[r]
            in_phase[r][phase] += wait + transfer
            calls[r].append(wait + transfer)


def _write_telemetry(run_dir: Path, sc: Scenario, man: dict) -> None:
    world, batch, config = man["world"]["world_size"], man["batch"], man["config"]
    seq_len = config["model"]["seq_len"]
    tokens_per_step = batch["global_batch_size"] * seq_len
    timeline = _timeline(sc, world)
    mean_step = sum(max(r.step_s for r in rows) for rows in timeline) / len(timeline)
    tokens_per_s = tokens_per_step / mean_step
    peak = 989.4e12 if sc.gpu else None
    calibrated = 40e9
    # FLOPs per token chosen so that the run's MFU is the scenario's: the records stay mutually consistent.
    flops_per_token = sc.mfu * world * (peak or calibrated) / tokens_per_s
    writers = [TelemetryWriter(run_dir, r) for r in range(world)]
    for rank, w in enumerate(writers):
        w.write(
            "meta",
            t=T0,
            world_size=world,
            local_rank=rank,
            hostname=f"node{rank // 8}",
            pid=1000 + rank,
            cpu_count=sc.cpu_count,
            num_threads=1,
            device=f"cuda:{rank}" if sc.gpu else "cpu",
            sampler="nvml" if sc.gpu else "cpu",
            strategy=config["strategy"]["name"],
            precision=config["precision"]["name"],
            hw=man["hw"]["name"],
            compute_dtype="bf16" if "bf16" in config["precision"]["name"] else "fp32",
            num_parameters=man["num_parameters"],
            flops_per_token=flops_per_token,
            hardware_flops_per_token=flops_per_token,
            tokens_per_step=tokens_per_step,
            micro_batch_size=batch["micro_batch_size"],
            accumulation=batch["accumulation"],
            seq_len=seq_len,
            peak_flops=peak,
            peak_flops_source="datasheet" if peak else None,
            max_steps=sc.steps,
        )
        if not sc.gpu:
            w.write("calibration", t=T0, dtype="fp32", matrix_size=1024, flops_per_s=calibrated, seconds=0.5)
        if sc.expert_shares is not None:
            ep, experts = config["strategy"]["ep"], len(sc.expert_shares)
            w.write(
                "expert_layout",
                t=T0,
                layers=config["model"]["n_layers"],
                num_experts=experts,
                top_k=2,
                ep=ep,
                first_expert=rank % ep * experts // ep,
                num_local=experts // ep,
                placement=[list(sc.expert_placement) if sc.expert_placement else None] * config["model"]["n_layers"],
                capacity_factor=None,
                aux_loss_coef=0.01,
                routed_flops_per_token=sc.expert_flops_share * flops_per_token,
            )
    t = T0
    window: list[list[tuple[float, float, float]]] = []
    for step, rows in enumerate(timeline, start=1):
        t = max(r.start_t + r.step_s for r in rows)
        measured = []
        for rank, r in enumerate(rows):
            extra = {} if sc.bubble is None else {"bubble_fraction": sc.bubble}
            # As the collector times it: backward's wall time includes DDP's wait for the last buckets.
            local, wait = r.local_compute, r.comm_wait
            if not sc.grad_hook:
                local, wait = local + wait, 0.0
            measured.append((local, r.step_s, r.data))
            writers[rank].write(
                "step",
                t=r.start_t + r.step_s,
                step=step,
                step_s=r.step_s,
                start_t=r.start_t,
                data_wait_s=r.data,
                **({"data_cpu_s": sc.data_cpu * r.data} if sc.data_cpu is not None else {}),
                forward_s=r.forward,
                backward_s=r.backward_compute + r.comm_wait,
                optimizer_s=r.optimizer,
                local_compute_s=local,
                comm_wait_s=wait,
                tokens=tokens_per_step,
                **extra,
                **(
                    {"forward_comm_s": r.forward_comm, "backward_comm_s": r.backward_comm}
                    if sc.sync_in_phases and sc.timed_collectives
                    else {}
                ),
                **({"optimizer_comm_s": r.optimizer_comm} if sc.sync_in_optimizer and sc.timed_collectives else {}),
                **({"comm_calls_s": list(r.calls)} if sc.phase_calls and sc.timed_collectives else {}),
                **(
                    {
                        "all_to_all_s": sc.all_to_all_share * (r.forward_comm + r.backward_comm),
                        "all_to_all_calls_s": [sc.all_to_all_share * c for c in r.calls],
                        **({"all_to_all_after_experts": list(sc.after_experts)} if sc.after_experts else {}),
                    }
                    if sc.all_to_all and sc.timed_collectives
                    else {}
                ),
            )
            _sample(writers[rank], sc, rank, step, t)
            if sc.expert_shares is not None:
                routed = [round(share * tokens_per_step / world * 2) for share in sc.expert_shares]  # top-2
                layers = config["model"]["n_layers"]
                writers[rank].write(
                    "experts", t=t, step=step, routed=[routed] * layers, dropped=[[0] * len(routed)] * layers
                )
        window.append(measured)
        if step % 5 == 0:
            means = [[sum(v[r][k] for v in window) / len(window) for r in range(world)] for k in range(3)]
            writers[0].write(
                "ranks",
                t=t,
                step=step,
                window_steps=len(window),
                local_compute_s=means[0],
                step_s=means[1],
                data_wait_s=means[2],
            )
            window = []
    _write_nonfinite(writers, sc, t)
    if sc.hang_after is not None:
        for w in writers:
            w.write(
                "hang",
                t=t + 60,
                last_step=len(timeline),
                timeout_s=60,
                stacks_dir="hang",
                in_collective={str(r): r != 1 for r in range(world)},
                waiting_on_loader={"1": list(sc.hang_loader_frames)} if sc.hang_loader_frames else {},
            )
    elif sc.crash is not None:
        _write_profile(writers, sc, t, mean_step)  # its window ended before the crash
        _write_crash(run_dir, sc.crash, world, t)
    else:
        waits = _call_waits(timeline) if sc.phase_calls else None  # older scenarios' profiles stay as they were
        _write_end(writers, sc, t, mean_step, tokens_per_s, peak, calibrated, waits)
    for w in writers:
        w.close()


def _write_nonfinite(writers: list[TelemetryWriter], sc: Scenario, t: float) -> None:
    """The guard's records: each bad step's agreed verdict, on every rank that records it."""
    stop = _stopped_at(sc)
    ranks = range(len(writers)) if sc.nonfinite_ranks is None else sc.nonfinite_ranks
    for rank in ranks:
        for skipped, step in enumerate(sc.nonfinite if stop is None else (stop,), start=1):
            action = "stopped" if stop is not None else "skipped"
            total = 0 if stop is not None else skipped
            writers[rank].write("nonfinite", t=t, step=step, what=sc.nonfinite_what, action=action, skipped_total=total)


def _raised(error: Exception) -> Exception:
    try:
        raise error
    except Exception as caught:  # a real traceback, as a rank's except path has it
        return caught


def _write_crash(run_dir: Path, crash: tuple[int, int, str], world: int, t: float) -> None:
    """The crash records of a run: the raising rank's own, then each survivor's echo of its peer leaving."""
    rank, step, phase = crash
    error = _raised(ValueError("bad batch in training forward (deliberate)\nsecond line"))
    write_crash_record(run_dir, rank, error, step, phase)
    echo = "[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:2946"
    others = [r for r in range(world) if r != rank]
    for other in others:
        write_crash_record(run_dir, other, _raised(RuntimeError(echo)), step, "backward")
    for offset, r in enumerate([rank, *others]):  # the cause first, then its echoes
        path = crash_path(run_dir, r)
        path.write_text(json.dumps({**json.loads(path.read_text()), "t": t + 1 + offset}))


def _call_waits(timeline: list[list[RankStep]]) -> list[tuple[float, float]]:
    """Per rank, its mean wait per step inside the phases' collectives recorded call by call (beyond each call's
    minimum over the ranks), which the profiler sees inside the collectives' events, and its mean work before the
    calls it was late at (compute the profiler sees)."""
    world = len(timeline[0]) if timeline else 0
    waits = [(0.0, 0.0)] * world
    for rows in timeline:
        if not rows[0].calls:
            continue
        minima = [min(column) for column in zip(*(r.calls for r in rows), strict=True)]
        for rank, r in enumerate(rows):
            wait, work = waits[rank]
            waits[rank] = (wait + (sum(r.calls) - sum(minima)) / len(timeline), work + r.late_work / len(timeline))
    return waits


def _write_profile(
    writers: list[TelemetryWriter],
    sc: Scenario,
    t: float,
    mean_step: float,
    call_waits: list[tuple[float, float]] | None = None,
) -> None:
    for rank, w in enumerate(writers):
        slow = sc.slow_factor if rank == sc.slow_rank else 1.0
        wait, late_work = call_waits[rank] if call_waits else (0.0, 0.0)
        compute = (sc.forward + sc.backward + sc.optimizer) * slow + late_work
        comm = sc.profile_comm + wait
        overlap = sc.profile_comm * sc.overlap
        idle = max(0.0, mean_step - (compute + comm - overlap))
        if sc.gpu:
            # The device runs queued kernels while the host waits for them (at a sync, or between steps): it idles
            # only where the host launched nothing (host_gap), and its kernels fill the rest of the step.
            idle = min(sc.host_gap, mean_step)
            compute = mean_step - idle - (comm - overlap)
        w.write(
            "profile",
            t=t,
            steps=[11, 13],  # the window's first and last step, as the collector writes it
            total_s=3 * mean_step,
            compute_s=3 * compute,
            comm_s=3 * comm,
            overlap_s=3 * overlap,
            idle_s=3 * idle,
            comm_by_op={op: 3 * comm / len(sc.comm_ops) for op in sc.comm_ops},
            trace_file=None,
            backend="gloo",
        )


def _write_end(
    writers: list[TelemetryWriter],
    sc: Scenario,
    t: float,
    mean_step: float,
    tokens_per_s: float,
    peak: float | None,
    calibrated: float,
    call_waits: list[tuple[float, float]] | None = None,
) -> None:
    _write_profile(writers, sc, t, mean_step, call_waits)
    for w in writers:
        if sc.gpu:
            total = 80 * GIB
            w.write(
                "memory",
                t=t,
                peak_allocated_bytes=0.9 * sc.mem_fraction * total,
                peak_reserved_bytes=sc.mem_fraction * total,
                peak_rss_bytes=None,
                device_memory_bytes=total,
            )
        else:
            w.write(
                "memory",
                t=t,
                peak_allocated_bytes=None,
                peak_reserved_bytes=None,
                peak_rss_bytes=1.5 * GIB,
                device_memory_bytes=None,
            )
        stop = _stopped_at(sc)
        w.write("end", t=t, steps=sc.steps if stop is None else stop + 1, wall_s=t - T0)
    key = "mfu" if sc.gpu else "calibrated_mfu"
    writers[0].write(
        "throughput",
        t=t,
        tokens_per_s=tokens_per_s,
        **{key: sc.mfu, key.replace("mfu", "hfu"): sc.mfu},
        peak_flops=peak,
        calibrated_peak_flops=None if sc.gpu else calibrated,
        steps_measured=sc.steps,
    )


def _sample(w: TelemetryWriter, sc: Scenario, rank: int, step: int, t: float) -> None:
    if not sc.gpu:
        w.write(
            "sample",
            t=t,
            source="cpu",
            device_index=None,
            cpu_util_pct=95.0 + step % 3 if sc.cpu_util is None else sc.cpu_util[rank],
            rss_bytes=(1.2 + 0.01 * step) * GIB,
            mem_total_bytes=64 * GIB,
        )
        return
    throttled = rank == sc.throttle_rank and step % 5 != 0  # 80% of that device's samples
    w.write(
        "sample",
        t=t,
        source="nvml",
        device_index=rank,
        util_pct=97.0 - 5 * (step % 2),
        mem_used_bytes=sc.mem_fraction * 80 * GIB * 0.98,
        mem_total_bytes=80 * GIB,
        power_w=690.0,
        sm_clock_mhz=1350.0 if throttled else 1980.0,
        temp_c=89.0 if throttled else 62.0,
        throttle_reasons=list(sc.throttle_reasons) if throttled else [],
        **(
            {"power_limit_w": sc.power_limits_w[0], "default_power_limit_w": sc.power_limits_w[1]}
            if sc.power_limits_w
            else {}
        ),
    )


def slice_steps(run_dir: Path, first: int, last: int, out: Path) -> Path:
    """A copy of ``run_dir`` whose telemetry keeps only the meta records and the steps ``first``..``last``.

    One spawned run can then hold several scenarios in consecutive step ranges, each analysed on its own.
    """
    out.mkdir(parents=True)
    for name in ("run.json", ".hydra"):
        if (run_dir / name).is_file():
            (out / name).write_bytes((run_dir / name).read_bytes())
    (out / "telemetry").mkdir()
    for path in sorted((run_dir / "telemetry").glob("rank*.jsonl")):
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        kept = [r for r in records if r["kind"] == "meta" or (r["kind"] == "step" and first <= r["step"] <= last)]
        (out / "telemetry" / path.name).write_text("".join(json.dumps(r) + "\n" for r in kept))
    return out
