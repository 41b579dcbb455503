"""Room for a run's checkpoints before launch (checkpoint/space.py): the sizes, the count held, the refusal."""

from __future__ import annotations

from pathlib import Path

import pytest

from disttrain.checkpoint.space import GIB, check_checkpoint_space, checkpoint_bytes, checkpoint_space, checkpoints_held
from disttrain.config.errors import ConfigError
from disttrain.config.schema import TrainerConfig
from disttrain.planner.shapes import ModelShape


def trainer(max_steps: int, every: int, keep: int | None) -> TrainerConfig:
    return TrainerConfig(max_steps=max_steps, ckpt_every_n_steps=every, keep_last_n=keep)


def test_a_checkpoint_is_fp32_parameters_and_their_optimizer_states() -> None:
    assert checkpoint_bytes(ModelShape("adamw", 1_000_000)) == 12_000_000  # weights + two moments
    assert checkpoint_bytes(ModelShape("sgd-momentum", 1_000_000, optimizer_states=1.0)) == 8_000_000


@pytest.mark.parametrize(
    ("max_steps", "every", "keep", "held"),
    [
        (100, 20, None, 5),  # steps 20..100, the last the final one
        (110, 20, None, 6),  # the final step 110 is saved beside 20..100
        (1000, 20, 3, 4),  # three kept and the one being written
        (40, 20, 5, 2),  # fewer written than kept
        (100, 0, None, 0),  # no step checkpoints
    ],
)
def test_the_most_checkpoints_on_disk_at_once(max_steps: int, every: int, keep: int | None, held: int) -> None:
    assert checkpoints_held(trainer(max_steps, every, keep)) == held


def test_a_run_whose_checkpoints_do_not_fit_is_refused_with_the_keep_last_n_that_fits(tmp_path: Path) -> None:
    shape = ModelShape("big", GIB // 4, optimizer_states=0.0)  # 1 GiB a checkpoint: fp32 weights alone
    space = checkpoint_space(shape, trainer(1000, 100, None), tmp_path / "run" / "checkpoints", lambda p: 5 * GIB)
    assert space.where == tmp_path  # the nearest existing dir: the filesystem the checkpoints will land on
    assert (space.held, space.fits) == (10, False)
    with pytest.raises(ConfigError) as err:
        check_checkpoint_space(space)
    message = str(err.value)
    assert "trainer.keep_last_n" in message
    assert "10 checkpoints of 1.0 GiB each (10.0 GiB) would not fit the 5.0 GiB free" in message
    assert "set trainer.keep_last_n=4" in message  # 4 kept + 1 being written = 5 GiB
    check_checkpoint_space(checkpoint_space(shape, trainer(1000, 100, 4), tmp_path, lambda p: 5 * GIB))


def test_no_room_for_even_one_says_to_free_space(tmp_path: Path) -> None:
    space = checkpoint_space(ModelShape("big", GIB // 12), trainer(10, 5, 1), tmp_path, lambda p: GIB // 2)
    with pytest.raises(ConfigError, match=r"free space there, raise trainer\.ckpt_every_n_steps"):
        check_checkpoint_space(space)
