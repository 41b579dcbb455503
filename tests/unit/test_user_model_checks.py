"""A user's ``model._target_`` is found and checked before any rank starts: one-line import errors naming what is
missing, and one forward on the meta device that refuses a model whose output is not ``[batch, seq, vocab]`` logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from disttrain.config.errors import ConfigError
from disttrain.config.schema import CustomModelConfig
from disttrain.models.factory import check_logits_shape, model_facts
from disttrain.models.targets import resolve_target
from tests.plugins import BigramModel


@pytest.fixture
def user_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "userpkg").mkdir()
    (tmp_path / "userpkg" / "__init__.py").write_text("")
    (tmp_path / "userpkg" / "models.py").write_text("class Net:\n    class Inner:\n        pass\n")
    (tmp_path / "userpkg" / "needs_dep.py").write_text("import a_dependency_not_installed\n")
    (tmp_path / "userpkg" / "raises.py").write_text("raise RuntimeError('config file not found')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


@pytest.mark.parametrize(
    ("target", "problem"),
    [
        ("no_such_pkg.Model", "cannot import 'no_such_pkg.Model': no module named 'no_such_pkg'"),
        ("userpkg.models.Nett", "cannot import 'userpkg.models.Nett': 'userpkg.models' has no 'Nett'"),
        ("userpkg.modells.Net", "cannot import 'userpkg.modells.Net': 'userpkg' has no 'modells'"),
        ("userpkg.models.Net.Outer", "'userpkg.models.Net' has no 'Outer'"),
        ("userpkg.needs_dep.Net", "No module named 'a_dependency_not_installed'"),
        ("userpkg.raises.Net", "RuntimeError: config file not found"),
        ("userpkg..Net", "'userpkg..Net' is not a dotted path"),
    ],
)
def test_a_target_that_cannot_be_found_is_one_line_naming_what_is_missing(
    user_package: Path, target: str, problem: str
) -> None:
    with pytest.raises(ConfigError) as info:
        resolve_target(target, "model._target_")
    assert info.value.key == "model._target_" and problem in info.value.problem
    assert "\n" not in str(info.value)


def test_a_target_resolves_through_modules_and_attributes(user_package: Path) -> None:
    import userpkg.models  # type: ignore[import-not-found]

    assert resolve_target("userpkg.models.Net.Inner", "model._target_") is userpkg.models.Net.Inner
    assert resolve_target("tests.plugins.BigramModel", "model._target_") is BigramModel


def user_model(target: str, vocab: int = 16, seq: int = 8) -> CustomModelConfig:
    return CustomModelConfig(target=target, vocab_size=vocab, seq_len=seq)


@pytest.mark.parametrize(
    ("target", "returned"),
    [("tests.plugins.DictLogitsModel", "returned dict"), ("tests.plugins.PooledLogitsModel", "returned [2, 16]")],
)
def test_a_model_that_does_not_return_per_token_logits_is_refused(target: str, returned: str) -> None:
    with pytest.raises(ConfigError) as info:
        model_facts(user_model(target), seed=0)
    assert info.value.key == "model._target_"
    assert f"{returned}, not logits [2, 8, 16]" in info.value.problem


class PaddedHead(nn.Module):
    def __init__(self, columns: int) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(16, 4), nn.Linear(4, columns)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(tokens))


class NeedsRealValues(PaddedHead):
    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.max().item() > 100:  # data-dependent: meta tensors have no values
            raise ValueError("unreachable")
        return tokens.sum()


def test_a_padded_head_passes_a_narrow_one_fails_and_what_meta_cannot_run_is_left_to_the_run() -> None:
    with torch.device("meta"):
        check_logits_shape(PaddedHead(64), user_model("x.Padded"))  # GPT-2's padded vocabulary: fine
        with pytest.raises(ConfigError, match=r"returned \[2, 8, 12\]"):
            check_logits_shape(PaddedHead(12), user_model("x.Narrow"))  # token ids 12..15 have no logit
        check_logits_shape(NeedsRealValues(16), user_model("x.Data"))  # cannot tell on meta: no verdict
    model = PaddedHead(16)
    model.train()
    check_logits_shape(model.to("meta"), user_model("x.Mode"))
    assert model.training  # the check's eval() is undone
