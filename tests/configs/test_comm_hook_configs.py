"""strategy.comm_hook and optimizer=onebit_adam: every hook composes and builds a strategy that registers it (1-bit
Adam its own, shared with its optimizer); bad values name key and fix."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from disttrain.config.errors import ConfigError
from disttrain.config.parse import parse_run_config
from disttrain.config.strategy_schema import COMM_HOOKS, DDPConfig
from disttrain.models import apply_activation_checkpointing, build_model
from disttrain.strategies.comm_hooks import bf16_hook_for_gloo
from disttrain.strategies.ddp import HookedDDPStrategy, OneProcessStrategy, build_ddp, build_one_process
from disttrain.strategies.layout import parallel_layout, validate_run
from disttrain.strategies.onebit import OneBitComm, onebit_hook
from disttrain.strategies.powersgd import PowerSGDComm, powersgd_hook
from disttrain.strategies.registry import build_strategy
from tests.conftest import compose_train


def test_yaml_defaults_match_the_schema() -> None:
    run_cfg = parse_run_config(compose_train(["strategy=ddp"]))
    assert run_cfg.strategy == DDPConfig().for_accelerator("cpu")


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ([], False),  # CPU: DDP's own gradient buffers (the bucket views measured slower there)
        (["hw=8xa100"], True),  # GPUs: the views save a gradient-sized copy
        (["strategy.gradient_as_bucket_view=true"], True),
        (["hw=8xa100", "strategy.gradient_as_bucket_view=false"], False),
    ],
)
def test_gradient_as_bucket_view_is_decided_by_the_device_unless_set(overrides: list[str], expected: bool) -> None:
    run_cfg = parse_run_config(compose_train(["strategy=ddp", *overrides]))
    assert run_cfg.strategy.gradient_as_bucket_view is expected
    built = build_strategy(run_cfg, 2, apply_activation_checkpointing).strategy
    assert built._ddp_kwargs["gradient_as_bucket_view"] is expected
    backend = "nccl" if run_cfg.hw.accelerator == "gpu" else "gloo"
    assert build_ddp(DDPConfig(), backend)._ddp_kwargs["gradient_as_bucket_view"] is (backend == "nccl")


@pytest.mark.parametrize(("overrides", "expected"), [([], True), (["strategy.forward_sync_buffers=false"], False)])
def test_forward_buffer_sync_reaches_ddp_without_torchs_deprecation_warning(
    overrides: list[str], expected: bool, tmp_path: Path
) -> None:
    run_cfg = parse_run_config(compose_train(overrides))
    strategy = build_strategy(run_cfg, 2, apply_activation_checkpointing).strategy
    strategy.parallel_devices = [torch.device("cpu")]
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", FutureWarning)
            warnings.filterwarnings("error", message=".*broadcast_buffers.*")
            model = strategy._setup_model(build_model(run_cfg.model, seed=0))
        assert model.broadcast_buffers is expected  # forward_sync_buffers on torch >= 2.13 (the old name a property)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("hook", COMM_HOOKS)
def test_every_hook_builds_its_strategy(hook: str) -> None:
    overrides = ["strategy=ddp", f"strategy.comm_hook={hook}", "strategy.powersgd_rank=2"]
    run_cfg = parse_run_config(compose_train(overrides))
    validate_run(run_cfg)
    built = build_strategy(run_cfg, 2, apply_activation_checkpointing).strategy
    assert isinstance(built, HookedDDPStrategy)
    expected = {"none": None, "bf16": bf16_hook_for_gloo, "fp16": default_hooks.fp16_compress_hook}
    expected["powersgd"] = powersgd_hook
    assert built._ddp_comm_hook is expected[hook]
    if hook == "powersgd":
        state = built._ddp_comm_state
        assert isinstance(state, PowerSGDComm)
        assert state.state.matrix_approximation_rank == 2
        assert state.state.start_powerSGD_iter == 50 and state.state.use_error_feedback
    else:
        assert built._ddp_comm_state is None


def test_bf16_on_nccl_is_torchs_own_hook() -> None:
    # torch checks the NCCL version for its bf16 hook by name; only gloo gets the renamed one.
    run_cfg = parse_run_config(compose_train(["strategy.comm_hook=bf16"]))
    from disttrain.strategies.comm_hooks import build_comm_hook

    assert build_comm_hook(run_cfg.strategy, "nccl") == (None, default_hooks.bf16_compress_hook)


def test_powersgd_validates_on_the_default_run_and_with_bf16_mixed() -> None:
    for extra in ([], ["precision=bf16-mixed"], ["precision=bf16-true"]):
        validate_run(parse_run_config(compose_train(["strategy.comm_hook=powersgd", *extra])))
    validate_run(parse_run_config(compose_train(["strategy.comm_hook=bf16", "precision=bf16-mixed"])))


# (overrides, the key the error must name, a fragment of the problem, a fragment of the fix)
BAD = [
    (["strategy.comm_hook=bf17"], "strategy.comm_hook", "did you mean 'bf16'", "'powersgd'"),
    (["strategy.comm_hook=powersdg"], "strategy.comm_hook", "did you mean 'powersgd'", "'none'"),
    (["strategy.comm_hook=bf16", "hw.devices_per_node=1"], "strategy.comm_hook", "world size of 1",
     "strategy.comm_hook=none"),
    (["strategy.comm_hook=bf16", "precision=bf16-true"], "strategy.comm_hook", "already 2-byte bf16",
     "strategy.comm_hook=none"),
    (["strategy.comm_hook=fp16", "precision=bf16-true"], "strategy.comm_hook", "narrower range",
     "strategy.comm_hook=none"),
    (["strategy.comm_hook=powersgd", "strategy.powersgd_rank=0"], "strategy.powersgd_rank", ">= 1",
     "strategy.powersgd_rank=4"),
    (["strategy.comm_hook=powersgd", "strategy.powersgd_warmup_steps=1"], "strategy.powersgd_warmup_steps",
     "regroups", "powersgd_warmup_steps=2 or more"),
    (["strategy.comm_hook=powersgd", "strategy.powersgd_warmup_steps=220"], "strategy.powersgd_warmup_steps",
     "no PowerSGD step", "powersgd_warmup_steps < 220"),
    (["strategy.comm_hook=powersgd", "strategy.powersgd_rank=two"], "strategy.powersgd_rank", "expected int",
     "to a int"),
    (["+strategy.powersgd_ranks=2"], "strategy.powersgd_ranks", "did you mean 'powersgd_rank'", "valid keys"),
    (["optimizer=onebit_adam", "strategy=fsdp"], "optimizer", "strategy=fsdp reduces gradients its own way",
     "strategy=ddp"),
    (["optimizer=onebit_adam", "strategy=deepspeed"], "optimizer", "strategy=deepspeed", "strategy=ddp"),
    (["optimizer=onebit_adam", "strategy=megatron", "strategy.tp=2"], "optimizer", "strategy=megatron",
     "strategy=ddp"),
    (["optimizer=onebit_adam", "strategy=auto"], "optimizer", "strategy=auto", "strategy=ddp"),
    (["optimizer=onebit_adam", "strategy.comm_hook=powersgd"], "strategy.comm_hook", "sends no gradients",
     "strategy.comm_hook=none"),
    (["optimizer=onebit_adam", "optimizer.freeze_steps=0"], "optimizer.freeze_steps", "must be >= 1",
     "optimizer.freeze_steps < 220"),
    (["optimizer=onebit_adam", "optimizer.freeze_steps=220"], "optimizer.freeze_steps", "end before",
     "1 <= optimizer.freeze_steps < 220"),
    (["optimizer.name=onebit"], "optimizer.name", "is not one of", "optimizer.name=adamw"),
]  # fmt: skip


@pytest.mark.parametrize(("overrides", "key", "problem", "fix"), BAD, ids=[" ".join(b[0]) for b in BAD])
def test_bad_comm_option_names_key_and_fix(overrides: list[str], key: str, problem: str, fix: str) -> None:
    with pytest.raises(ConfigError) as info:
        validate_run(parse_run_config(compose_train(overrides)))
    assert info.value.key == key
    assert problem in info.value.problem, info.value.problem
    assert fix in info.value.fix, info.value.fix


def test_powersgd_settings_are_ignored_without_the_hook() -> None:
    # Sweeping comm_hook=none,powersgd with PowerSGD settings pinned must keep arm A valid.
    validate_run(parse_run_config(compose_train(["strategy.powersgd_warmup_steps=1", "strategy.powersgd_rank=0"])))


def test_onebit_adam_shares_one_schedule_between_ddp_the_module_and_one_process() -> None:
    run_cfg = parse_run_config(compose_train(["optimizer=onebit_adam", "optimizer.freeze_steps=40"]))
    mesh = parallel_layout(run_cfg).mesh
    assert mesh is not None and mesh.onebit_adam  # the planner prices its exchange, not DDP's all-reduce
    built = build_strategy(run_cfg, 2, apply_activation_checkpointing)
    assert isinstance(built.onebit, OneBitComm) and built.onebit.freeze_steps == 40
    assert built.strategy._ddp_comm_hook is onebit_hook and built.strategy._ddp_comm_state is built.onebit
    assert built.strategy.rank_state is built.onebit  # its error feedback is kept beside each checkpoint
    one = build_one_process("cpu", built.onebit)
    assert isinstance(one, OneProcessStrategy) and one.rank_state is built.onebit
    assert build_one_process("cpu").rank_state is None
    plain = build_strategy(parse_run_config(compose_train([])), 2, apply_activation_checkpointing)
    assert plain.onebit is None and plain.strategy.rank_state is None
