"""Learning-rate schedule, weight-decay groups, and the run-dir checkpoint helpers."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from disttrain.checkpoint.files import checkpoint_name, relink_last
from disttrain.checkpoint.resume import find_resume_point, original_overrides
from disttrain.config.errors import ConfigError
from disttrain.config.schema import OptimizerConfig
from disttrain.models.module import LanguageModelModule, lr_lambda, param_groups


def test_lr_schedule_warms_up_then_decays_to_min() -> None:
    values = [lr_lambda(s, warmup_steps=10, max_steps=110, min_lr_ratio=0.1) for s in range(111)]
    assert values[0] == pytest.approx(0.1)
    assert values[9] == pytest.approx(1.0)
    assert values[10] == pytest.approx(1.0)
    assert values[60] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert values[110] == pytest.approx(0.1)
    assert all(a >= b for a, b in itertools.pairwise(values[10:]))


def test_matrices_decay_vectors_do_not() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    decay, no_decay = param_groups(model, 0.1)
    assert [p.shape for p in decay["params"]] == [(4, 4)]
    assert decay["weight_decay"] == 0.1
    assert sorted(p.numel() for p in no_decay["params"]) == [4, 4, 4]
    assert no_decay["weight_decay"] == 0.0


def test_find_resume_point_takes_the_newest_complete_step(tmp_path: Path) -> None:
    ckpts = tmp_path / "run" / "checkpoints"
    ckpts.mkdir(parents=True)
    for step in (100, 20, 300):
        torch.save({"global_step": step}, ckpts / checkpoint_name(step))
    assert find_resume_point(str(tmp_path / "run")).checkpoint.name == "step000300.ckpt"
    # last.ckpt is a convenience link; a kill between publishing a checkpoint and relinking can leave it behind.
    relink_last(ckpts, checkpoint_name(100))
    assert find_resume_point(str(tmp_path / "run")).checkpoint.name == "step000300.ckpt"
    assert find_resume_point(str(ckpts / "step000020.ckpt")).checkpoint.name == "step000020.ckpt"


def test_find_resume_point_errors_name_resume(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist") as info:
        find_resume_point(str(tmp_path / "missing"))
    assert info.value.key == "resume"
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="no checkpoint found"):
        find_resume_point(str(tmp_path / "empty"))


def test_original_overrides_come_from_hydra_record(tmp_path: Path) -> None:
    (tmp_path / ".hydra").mkdir()
    (tmp_path / ".hydra" / "overrides.yaml").write_text("- strategy=fsdp\n- trainer.max_steps=50\n")
    assert original_overrides(str(tmp_path)) == ["strategy=fsdp", "trainer.max_steps=50"]
    assert original_overrides(str(tmp_path / "checkpoints" / "last.ckpt")) == ["strategy=fsdp", "trainer.max_steps=50"]


def test_throughput_leaves_out_checkpoint_writes_and_validation(monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    from disttrain.training import callbacks

    clock = {"now": 0.0}
    monkeypatch.setattr(callbacks.time, "perf_counter", lambda: clock["now"])
    saving = {"s": 3.0}  # a save before the measured steps began does not count either
    throughput = callbacks.Throughput(units_per_step=100, skip_steps=1, saving_s=lambda: saving["s"])
    trainer = SimpleNamespace(global_step=0)
    for step in range(1, 6):  # one second of training per step; step 3 also saves for 2 s, then validates 4 s
        clock["now"] += 1.0
        if step == 3:
            clock["now"] += 2.0
            saving["s"] += 2.0
        trainer.global_step = step
        throughput.on_train_batch_end(trainer)  # type: ignore[arg-type]
        if step == 3:
            throughput.on_validation_start()
            clock["now"] += 4.0
            throughput.on_validation_end()
    assert throughput.train_time_s == pytest.approx(4.0)
    assert throughput.tokens_per_s == pytest.approx(4 * 100 / 4.0)


def test_throughput_median_step_leaves_out_warm_up_saves_validation_and_counts_optimizer_steps(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from types import SimpleNamespace

    from disttrain.training import callbacks

    clock = {"now": 0.0}
    monkeypatch.setattr(callbacks.time, "perf_counter", lambda: clock["now"])
    saving = {"s": 0.0}
    throughput = callbacks.Throughput(units_per_step=100, skip_steps=2, saving_s=lambda: saving["s"])
    trainer = SimpleNamespace(global_step=0)
    durations = {1: 9.0, 2: 9.0, 3: 1.0, 4: 1.5, 5: 1.0, 6: 2.0, 7: 1.0, 8: 1.2}  # steps 1-2: warm-up
    assert throughput.step_time_p50_s is None
    for step, seconds in durations.items():
        for micro in range(2):  # accumulation 2: the hook runs per micro-batch, the step advances on the last
            clock["now"] += seconds / 2
            if step == 5 and micro == 1:  # a save inside step 5's end hooks
                clock["now"] += 30.0
                saving["s"] += 30.0
            trainer.global_step = step if micro == 1 else step - 1
            throughput.on_train_batch_end(trainer)  # type: ignore[arg-type]
        if step == 6:  # validation after step 6: step 7's interval holds it
            throughput.on_validation_start()
            clock["now"] += 50.0
            throughput.on_validation_end()
    # Timed: steps 3, 4, 6, 8 (5 held a save, 7 a validation; 1-2 are the warm-up).
    assert list(throughput.step_times_s) == pytest.approx([1.0, 1.5, 2.0, 1.2])
    assert throughput.step_time_p50_s == pytest.approx(1.35)


def test_the_logged_loss_is_reduced_over_ranks_after_backward_not_inside_forward() -> None:
    """training_step issues no collective (a rank waiting there for a late peer would look slow in forward itself,
    hiding the late rank from the diagnostics' order of arrival); the step's loss, the mean of its accumulated
    micro-batches, is logged with sync_dist once all of them ran: under DeepSpeed the hook comes after each one."""
    module = LanguageModelModule(
        lambda: nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 16)),
        OptimizerConfig(),
        max_steps=10,
        log_every_n_steps=1,
        accumulation=2,
    )
    module.configure_model()
    logged: list[tuple[str, float, bool]] = []
    module.log = lambda name, value, **kw: logged.append((name, float(value), kw.get("sync_dist", False)))  # type: ignore[method-assign]
    torch.manual_seed(0)
    batches = [(torch.randint(0, 16, (2, 5)), torch.randint(0, 16, (2, 5))) for _ in range(2)]
    losses = [float(module.training_step(batch, i).detach()) for i, batch in enumerate(batches[:1])]
    module.on_before_optimizer_step(torch.optim.SGD(module.parameters(), lr=0.1))  # DeepSpeed: after micro-batch 1
    assert logged == []
    losses.append(float(module.training_step(batches[1], 1).detach()))
    assert logged == []  # nothing inside forward
    module.on_before_optimizer_step(torch.optim.SGD(module.parameters(), lr=0.1))
    assert logged == [("train/loss", pytest.approx(sum(losses) / 2), True)]
