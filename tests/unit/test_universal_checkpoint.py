"""The universal checkpoint's parts without a process group: name mapping, DCP round trips in one process, loop
counters restated for another layout, legacy-format refusals, chained resume overrides, RNG re-seeding."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import yaml
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

from disttrain.checkpoint import universal
from disttrain.checkpoint.compat import check_strategy_can_read, legacy_writer
from disttrain.checkpoint.loops import restate_fit_loop
from disttrain.checkpoint.rng import rank_seed
from disttrain.config.errors import ConfigError
from disttrain.job.prepare import dropped_by_new_choices, recorded_overrides
from disttrain.strategies.deepspeed_state import moment_keys, param_names, persistent_buffers


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(8, 4)
        self.lm_head = nn.Linear(4, 8, bias=False)
        self.lm_head.weight = self.tok_emb.weight
        self.norm = nn.LayerNorm(4)
        self.register_buffer("rope", torch.ones(3), persistent=False)
        self.register_buffer("count", torch.zeros(1))


class Wrapper(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.model = Tied()


def trained(seed: int) -> tuple[Wrapper, torch.optim.AdamW]:
    module = Wrapper(seed)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2)
    for _ in range(2):
        module.model.norm(module.model.tok_emb(torch.tensor([1, 2]))).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    return module, optimizer


def save(path: Path, module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    state = get_optimizer_state_dict(module, optimizer, options=universal.flat_optimizer_options())
    universal.save(path, get_model_state_dict(module), [state], {"global_step": 2}, is_global_zero=True)


def test_round_trip_in_one_process_reads_model_and_optimizer_by_name(tmp_path: Path) -> None:
    source, source_opt = trained(0)
    save(tmp_path / "c", source, source_opt)
    assert universal.is_universal(tmp_path / "c") and not universal.is_universal(tmp_path)
    target = Wrapper(1)
    target_opt = torch.optim.AdamW(target.parameters(), lr=5.0)
    model_state = get_model_state_dict(target)
    opt_state = get_optimizer_state_dict(target, target_opt, options=universal.flat_optimizer_options())
    universal.read_into(tmp_path / "c", model_state, [opt_state])
    for name, tensor in get_model_state_dict(source).items():
        assert torch.equal(model_state[name], tensor), name
    wanted = get_optimizer_state_dict(source, source_opt, options=universal.flat_optimizer_options())
    assert torch.equal(opt_state["state.model.tok_emb.weight.exp_avg"], wanted["state.model.tok_emb.weight.exp_avg"])
    assert float(opt_state["state.model.norm.weight.step"]) == 2.0
    assert opt_state["param_groups.model.norm.weight.lr"] == 1e-2  # the saved hyper-parameter, not this run's 5.0


def test_missing_model_tensor_is_named(tmp_path: Path) -> None:
    source, source_opt = trained(0)
    save(tmp_path / "c", source, source_opt)
    state = get_model_state_dict(Wrapper(1)) | {"model.extra.weight": torch.zeros(2)}
    with pytest.raises(universal.MissingState, match=r"no 'model.extra.weight' \(1 of this model's 6 tensors"):
        universal.read_into(tmp_path / "c", state, [])


def test_missing_optimizer_hyperparameter_keeps_this_runs_value_but_a_missing_moment_is_refused(
    tmp_path: Path,
) -> None:
    source, source_opt = trained(0)
    save(tmp_path / "c", source, source_opt)
    target = Wrapper(1)
    opt = torch.optim.AdamW(target.parameters(), lr=5.0)
    state = get_optimizer_state_dict(target, opt, options=universal.flat_optimizer_options())
    state["param_groups.model.norm.weight.only_here"] = 7
    universal.read_into(tmp_path / "c", None, [state])
    assert state["param_groups.model.norm.weight.only_here"] == 7
    state["state.model.norm.weight.momentum_buffer"] = torch.zeros(4)
    with pytest.raises(universal.MissingState, match="resume_weights_only=true"):
        universal.read_into(tmp_path / "c", None, [state])


def test_a_pipeline_stages_own_lm_head_reads_the_tied_embeddings_optimizer_state(tmp_path: Path) -> None:
    """One process optimizes the tied weight as tok_emb.weight; a last stage holds lm_head.weight on its own."""
    source, source_opt = trained(0)
    save(tmp_path / "c", source, source_opt)
    wanted = get_optimizer_state_dict(source, source_opt, options=universal.flat_optimizer_options())
    stage = {
        "state.model.lm_head.weight.exp_avg": torch.zeros(8, 4),
        "state.model.lm_head.weight.step": torch.tensor(0.0),
        "param_groups.model.lm_head.weight.lr": 5.0,
    }
    with pytest.raises(universal.MissingState):
        universal.read_into(tmp_path / "c", None, [copy.deepcopy(stage)])
    universal.read_into(tmp_path / "c", None, [stage], twins={"model.lm_head.weight": "model.tok_emb.weight"})
    assert torch.equal(stage["state.model.lm_head.weight.exp_avg"], wanted["state.model.tok_emb.weight.exp_avg"])
    assert (
        float(stage["state.model.lm_head.weight.step"]) == 2.0 and stage["param_groups.model.lm_head.weight.lr"] == 1e-2
    )


def test_deepspeed_names_every_alias_of_a_tied_weight_and_only_persistent_buffers() -> None:
    module = Wrapper(0)
    names = param_names(module)
    assert names[id(module.model.tok_emb.weight)] == ["model.tok_emb.weight", "model.lm_head.weight"]
    assert [name for name, _ in persistent_buffers(module)] == ["model.count"]
    index = {"optimizer_0.state.model.norm.weight.exp_avg": 0, "optimizer_0.state.model.norm.weight.step": 0}
    index |= {"optimizer_0.state.model.norm.weight.exp_avg_sq": 0}
    assert moment_keys(index, "optimizer_0", ["model.tok_emb.weight", "model.norm.weight"]) == ("exp_avg", "exp_avg_sq")


def fit_loop(ready: int, completed: int, steps: int, manual_steps: int) -> dict:
    progress = {"ready": ready, "started": ready, "processed": ready, "completed": completed}
    step = {"total": {"ready": steps, "completed": steps}, "current": {"ready": steps, "completed": steps}}
    manual = {"ready": manual_steps, "completed": manual_steps}
    return {
        "epoch_loop.batch_progress": {"total": dict(progress), "current": dict(progress), "is_last_batch": False},
        "epoch_loop.automatic_optimization.optim_progress": {
            "optimizer": {"step": step, "zero_grad": copy.deepcopy(step)}
        },
        "epoch_loop.manual_optimization.optim_step_progress": {"total": manual, "current": dict(manual)},
    }


def test_loop_counters_are_restated_in_optimizer_steps() -> None:
    saved = fit_loop(ready=3, completed=2, steps=3, manual_steps=0)  # DDP, 1 batch per step, at step 3
    assert restate_fit_loop(copy.deepcopy(saved), 3, 1, manual=False) == saved  # the same layout: untouched
    doubled = restate_fit_loop(copy.deepcopy(saved), 3, 2, manual=False)  # 2 accumulated micro-batches per step
    assert doubled["epoch_loop.batch_progress"]["total"] == {"ready": 6, "started": 6, "processed": 6, "completed": 5}
    manual = restate_fit_loop(copy.deepcopy(saved), 3, 1, manual=True)  # into Megatron's manual optimization
    assert manual["epoch_loop.manual_optimization.optim_step_progress"]["total"] == {"ready": 3, "completed": 3}
    automatic = manual["epoch_loop.automatic_optimization.optim_progress"]["optimizer"]["step"]["total"]
    assert automatic == {"ready": 0, "completed": 0}
    back = restate_fit_loop(copy.deepcopy(manual), 3, 2, manual=False)  # and back out of it, with accumulation
    assert back["epoch_loop.automatic_optimization.optim_progress"]["optimizer"]["step"]["total"]["completed"] == 3
    assert back["epoch_loop.batch_progress"]["total"]["ready"] == 6


def test_pre_universal_formats_resume_only_under_their_writer(tmp_path: Path) -> None:
    (tmp_path / "step000003.ckpt").write_bytes(b"zip")
    ddp_file = tmp_path / "step000003.ckpt"
    zero = tmp_path / "zero.ckpt"
    (zero / "checkpoint").mkdir(parents=True)
    (zero / "latest").write_text("checkpoint")
    for rank in range(2):
        (zero / "checkpoint" / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt").write_bytes(b"")
    assert (legacy_writer(ddp_file), legacy_writer(zero)) == ("ddp", "deepspeed")
    check_strategy_can_read(ddp_file, "ddp", 4)  # any world size: a full replica
    check_strategy_can_read(zero, "deepspeed", 2)
    with pytest.raises(ConfigError, match=r"strategy: 'step000003\.ckpt' is in strategy=ddp's own pre-universal"):
        check_strategy_can_read(ddp_file, "fsdp", 2)
    with pytest.raises(ConfigError, match=r"hw.devices_per_node: .*ZeRO partitions of 2 ranks; this run has 4"):
        check_strategy_can_read(zero, "deepspeed", 4)


def test_a_re_chosen_group_drops_the_old_choices_options() -> None:
    original = ["strategy=deepspeed", "strategy.stage=2", "model.n_layers=2", "trainer.micro_batch_size=4"]
    assert dropped_by_new_choices(original, ["strategy=fsdp"]) == ["model.n_layers=2", "trainer.micro_batch_size=4"]
    assert dropped_by_new_choices(original, ["strategy=deepspeed", "strategy.stage=3"]) == original


def record(run_dir: Path, overrides: list[str]) -> Path:
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    (run_dir / "checkpoints" / "step000002.ckpt").mkdir(parents=True)
    return run_dir / "checkpoints" / "step000002.ckpt"


def test_a_resumed_runs_overrides_include_the_runs_it_resumed(tmp_path: Path) -> None:
    first = record(tmp_path / "a", ["model.n_layers=2", "strategy=deepspeed", "strategy.stage=2"])
    second = record(tmp_path / "b", [f"resume={first}", "strategy=fsdp"])
    third = record(tmp_path / "c", [f"resume={second}", "hw.devices_per_node=1"])
    assert recorded_overrides(str(third)) == ["model.n_layers=2", "strategy=fsdp", "hw.devices_per_node=1"]


def test_reseeding_is_deterministic_and_differs_per_rank() -> None:
    assert rank_seed(0, 10, 1) == rank_seed(0, 10, 1)
    assert len({rank_seed(0, 10, rank) for rank in range(8)} | {rank_seed(0, 11, 0)}) == 9
    assert all(0 <= rank_seed(s, 5, 3) < 2**32 for s in range(5))
