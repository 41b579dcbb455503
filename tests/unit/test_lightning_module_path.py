"""A user's own LightningModule: told apart from a token model, built by Hydra, counted, sharded by FSDP2's plan for
any module, its data in one order for every world size, and refused in one line where it cannot run."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from diagnostics.analysis.context import RunContext
from diagnostics.analysis.finding import Finding
from diagnostics.analysis.summary import Summary
from diagnostics.kinds.needs import gated
from disttrain.config.errors import ConfigError
from disttrain.config.parse import parse_model
from disttrain.config.schema import CustomDataConfig, CustomModelConfig, LightningModuleConfig
from disttrain.config.strategy_schema import FSDPConfig
from disttrain.data.samples import batch_rows, rows_problem
from disttrain.data.user_datamodule import datamodule_arguments, describe_batch_size
from disttrain.data.user_loaders import EpochShardedSampler, sharded
from disttrain.models.facts import ModelFacts
from disttrain.models.user_module import (
    apply_in_configure_model,
    build_lightning_module,
    check_manual_optimization,
    compile_submodules,
    lightning_module_facts,
    resolve_model_kind,
    with_compile_first,
)
from disttrain.strategies.fsdp_user import refuse_own_parameters, roots, units_by_class, units_by_size, wrap_classes
from disttrain.training.flop_count import FirstStepFlops, is_compiled
from tests.conftest import CONF, compose_train
from tests.lightning_projects import classifier, recommender

CLASSIFIER = "tests.lightning_projects.classifier"
LIT_CLASSIFIER = {"net": {"_target_": f"{CLASSIFIER}.ConvNet", "channels": 4}}


def classifier_config(**kwargs: object) -> LightningModuleConfig:
    return LightningModuleConfig(f"{CLASSIFIER}.LitClassifier", kwargs={**LIT_CLASSIFIER, **kwargs})


def test_a_target_without_token_keys_is_a_lightning_module_and_with_them_a_token_model() -> None:
    lit = parse_model({"_target_": "pkg.Lit", "lr": 0.1, "net": {"_target_": "pkg.Net"}})
    assert lit == LightningModuleConfig("pkg.Lit", kwargs={"lr": 0.1, "net": {"_target_": "pkg.Net"}})
    token = parse_model({"_target_": "pkg.Model", "vocab_size": 16, "seq_len": 8, "width": 4})
    assert isinstance(token, CustomModelConfig) and token.kwargs == {"width": 4}


def test_the_kind_is_what_the_target_is_once_imported() -> None:
    lit = classifier_config()
    assert resolve_model_kind(lit) is lit
    # A LightningModule that takes the token keys keeps them as its arguments.
    as_token = CustomModelConfig(f"{CLASSIFIER}.LitClassifier", vocab_size=16, seq_len=8, kwargs={"lr": 0.1})
    resolved = resolve_model_kind(as_token)
    assert isinstance(resolved, LightningModuleConfig)
    assert resolved.kwargs == {"vocab_size": 16, "seq_len": 8, "lr": 0.1}
    # A plain nn.Module without them cannot be trained as a token model: the key that is missing is named.
    with pytest.raises(ConfigError) as err:
        resolve_model_kind(LightningModuleConfig(f"{CLASSIFIER}.ConvNet"))
    assert err.value.key == "model.vocab_size" and "not a LightningModule" in err.value.problem
    with pytest.raises(ConfigError, match="is a int"):
        resolve_model_kind(LightningModuleConfig("tests.unit.test_lightning_module_path.NOT_A_CLASS"))


NOT_A_CLASS = 3


def lit_factory(lr: float = 0.1) -> pl.LightningModule:
    return classifier.LitClassifier(classifier.ConvNet(channels=2), lr=lr)


def not_a_lit_factory() -> nn.Module:
    return nn.Linear(2, 2)


def test_hydra_builds_nested_targets_and_factories_and_errors_are_one_line() -> None:
    module = build_lightning_module(classifier_config(lr=0.2))
    assert isinstance(module.net, classifier.ConvNet) and module.net.conv1.out_channels == 4
    assert module.hparams.lr == 0.2  # the user's save_hyperparameters ran
    built = build_lightning_module(LightningModuleConfig(f"{__name__}.lit_factory", kwargs={"lr": 0.3}))
    assert built.hparams.lr == 0.3
    cases = {
        "model.net._target_": classifier_config(net={"_target_": f"{CLASSIFIER}.ConvNt"}),
        "model._target_": classifier_config(bogus=1),
    }
    for key, cfg in cases.items():
        with pytest.raises(ConfigError) as err:
            build_lightning_module(cfg)
        assert err.value.key == key and "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="returned Linear, not a LightningModule"):
        build_lightning_module(LightningModuleConfig(f"{__name__}.not_a_lit_factory"))


def test_facts_count_parameters_on_meta_and_read_what_the_module_states() -> None:
    facts = lightning_module_facts(LightningModuleConfig("tests.lightning_projects.recommender.LitRecommender"))
    table = recommender.LitRecommender()
    assert facts.num_parameters == sum(p.numel() for p in table.parameters()) >= 2_000_000
    assert facts.flops_per_sample is None and facts.tokens_per_sample is None and facts.automatic_optimization
    stated = lightning_module_facts(LightningModuleConfig(f"{__name__}.StatingModule"))
    assert stated.flops_per_sample == 1234.0 and stated.tokens_per_sample == 32


class StatingModule(pl.LightningModule):
    tokens_per_sample = 32

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 4)

    def flops_per_sample(self) -> float:
        return 1234.0


def conv_flops(c_in: int, c_out: int, kernel: int, h: int, w: int) -> int:
    return 2 * c_out * h * w * c_in * kernel * kernel


def test_counted_flops_of_a_conv_net_match_a_hand_count() -> None:
    """Forward: 2 MACs a weight a position; backward: as much again for the weights' gradient and for the input's,
    except the first layer, whose input (the images) needs none."""
    size, channels, classes, batch = 12, 8, 10, 16
    module = classifier.LitClassifier(classifier.ConvNet(channels, classes, size))
    data = classifier.DigitsData(batch_size=batch, size=size)
    images, labels = next(iter(data.train_dataloader()))
    counter = FirstStepFlops()
    trainer = SimpleNamespace(global_step=0)
    counter.on_train_batch_start(trainer, module, (images, labels), 0)  # type: ignore[arg-type]
    F.cross_entropy(module(images), labels).backward()
    counter.on_train_batch_end(trainer, module)  # type: ignore[arg-type]
    conv1 = conv_flops(1, channels, 3, size, size)
    conv2 = conv_flops(channels, 2 * channels, 3, size, size)
    head = 2 * 2 * channels * (size // 2) ** 2 * classes
    hand = (2 * conv1 + 3 * conv2 + 3 * head) * batch
    assert counter.flops_per_sample == pytest.approx(hand / batch, rel=0.05)
    # Counted once: a later step runs without the counter.
    counter.on_train_batch_start(SimpleNamespace(global_step=1), module, (images, labels), 1)  # type: ignore[arg-type]
    assert counter._mode is None


@dataclasses.dataclass
class Batch:
    meta: str
    features: torch.Tensor


@pytest.mark.parametrize(
    ("batch", "rows"),
    [
        (torch.zeros(5, 3), 5),
        ((torch.zeros(4, 2), torch.zeros(4)), 4),
        ({"user": torch.zeros(7, dtype=torch.long), "item": torch.zeros(7)}, 7),
        (Batch("x", torch.zeros(6, 2)), 6),
        ([{"a": [torch.zeros(3, 1)]}], 3),
        ({"name": "no tensors"}, None),
        (torch.tensor(1.0), None),
    ],
)
def test_samples_are_the_rows_of_the_first_tensor_of_any_batch(batch: object, rows: int | None) -> None:
    assert batch_rows(batch) == rows


def test_a_first_batch_of_another_size_than_the_micro_batch_is_named() -> None:
    assert rows_problem(torch.zeros(16, 2), 16) is None
    assert rows_problem(torch.zeros(32, 2), 16) == "holds 32 samples, and trainer.micro_batch_size=16"
    assert "no tensor" in str(rows_problem({"x": 1}, 16))


class NoBatchSize(pl.LightningDataModule):
    def __init__(self, size: int = 3) -> None:
        super().__init__()

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(torch.zeros(8, 1)), batch_size=4)


def test_the_micro_batch_reaches_a_datamodule_as_batch_size_where_it_takes_one() -> None:
    digits = CustomDataConfig(f"{CLASSIFIER}.DigitsData", kwargs={"noise": 0.5})
    assert datamodule_arguments(digits, 16, None) == {"batch_size": 16, "noise": 0.5}
    assert describe_batch_size(digits, 16) == "data: DigitsData(batch_size=16) from trainer.micro_batch_size"
    own = CustomDataConfig(f"{__name__}.NoBatchSize", kwargs={"size": 2})
    assert datamodule_arguments(own, 16, None) == {"size": 2}
    assert "takes no batch_size" in describe_batch_size(own, 16)
    # A token model's datamodule keeps its contract.
    assert datamodule_arguments(own, 16, 32) == {"seq_len": 32, "micro_batch_size": 16, "size": 2}


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("world", [2, 4])
def test_n_ranks_see_together_what_one_process_sees_with_n_times_the_batch(shuffle: bool, world: int) -> None:
    data = TensorDataset(torch.arange(40))
    micro = 3

    def batches(ranks: int, batch: int) -> list[list[list[int]]]:
        per_rank = []
        for rank in range(ranks):
            loader = sharded(DataLoader(data, batch_size=batch, shuffle=shuffle), rank, ranks, seed=7)
            assert isinstance(loader.sampler, EpochShardedSampler)
            loader.sampler.set_epoch(1)
            per_rank.append([b[0].tolist() for b in loader])
        return per_rank

    one = batches(1, micro * world)[0]
    many = batches(world, micro)
    full = [step for step, batch in enumerate(one) if len(batch) == micro * world]
    assert len(full) >= 3
    for step in full:
        together = [sample for rank in many for sample in rank[step]]
        assert sorted(together) == sorted(one[step])
    # A loader with a sampler of the user's own is left as it is.
    own = DataLoader(data, sampler=list(range(5)))
    assert sharded(own, 0, 2, seed=7) is own


class Blocky(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(100, 16)  # 1600
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16)) for _ in range(2)])  # 544 each
        self.head = nn.Linear(16, 4)


def test_fsdp_units_by_size_or_class_and_the_roots_are_the_children_that_run_a_forward() -> None:
    module = Blocky()
    (first, second), (third, fourth) = module.blocks
    units = units_by_size(module, min_params=200)
    assert units == [module.embed, first, second, third, fourth]  # bottom-up; the small head is left over
    # A Sequential is looked into, never a unit or root itself: code that indexes it calls only its members.
    assert units_by_size(module, min_params=500) == [module.embed]
    assert units_by_size(module, min_params=10_000) == []
    assert roots(module) == [module.embed, first, second, third, fourth, module.head]
    by_class = units_by_class(module, (nn.Sequential,))  # named in strategy.fsdp_wrap, it is one
    assert by_class == [module.blocks[1], module.blocks[0]]
    with pytest.raises(ConfigError, match="holds no module of class Conv2d"):
        units_by_class(module, (nn.Conv2d,))
    with pytest.raises(ConfigError) as err:
        wrap_classes(FSDPConfig(fsdp_wrap=["torch.nn.Linear", "torch.nn.functional.relu"]))
    assert err.value.key == "strategy.fsdp_wrap[1]"
    module.scale = nn.Parameter(torch.ones(1))
    with pytest.raises(ConfigError, match="scale belong"):
        refuse_own_parameters(module)


def test_the_plan_runs_once_after_the_users_own_configure_model() -> None:
    calls: list[str] = []

    class Own(Blocky):
        def configure_model(self) -> None:
            calls.append("user")

    module = Own()
    apply_in_configure_model(module, lambda m, mesh: calls.append("plan"))
    module.configure_model()
    module.configure_model()
    assert calls == ["user", "plan", "user"]


def test_manual_optimization_runs_one_micro_batch_a_step_and_clips_itself() -> None:
    manual = ModelFacts(10, None, automatic_optimization=False)
    assert check_manual_optimization(ModelFacts(10, None), 4, 1.0) is None
    with pytest.raises(ConfigError) as err:
        check_manual_optimization(manual, 2, 1.0)
    assert err.value.key == "trainer.global_batch_size"
    assert "self.clip_gradients" in str(check_manual_optimization(manual, 1, 1.0))
    assert check_manual_optimization(manual, 1, 0.0) is None


LIT = ["~model", f"+model._target_={CLASSIFIER}.LitClassifier", f"+model.net._target_={CLASSIFIER}.ConvNet"]
DATA = ["~data", f"+data._target_={CLASSIFIER}.DigitsData"]


@pytest.mark.parametrize(
    ("overrides", "key", "said"),
    [
        ([], "data", "reads the batches of its own datamodule"),
        ([*DATA, "+data.batch_size=64"], "data.batch_size", "differs from trainer.micro_batch_size=16"),
        ([*DATA, "strategy=megatron"], "strategy", "a user model"),
        ([*DATA, "optimizer.lr=0.1"], "optimizer.lr", "does not reach a LightningModule"),
    ],
)
def test_what_a_lightning_module_cannot_be_composed_with_is_refused_before_launch(
    overrides: list[str], key: str, said: str
) -> None:
    from disttrain.job.prepare import prepare

    composed = compose_train([*LIT, *overrides])
    with pytest.raises(ConfigError) as err:
        prepare(composed, None, [*LIT, *overrides])
    assert err.value.key == key and said in err.value.problem


def context(work: dict | None) -> RunContext:
    return RunContext({"optimizer": {"name": "adamw", "lr": 1e-3}}, {"data_parallel_size": 2}, 4, work=work)


def test_levers_a_lightning_module_cannot_take_are_explained_not_recommended() -> None:
    from diagnostics.kinds.levers import lever

    finding = Finding("comm_bound", "warning", [0, 1], {}, "communication is exposed")
    recs = [lever("optimizer.lr", 5e-4, "why", "effect"), lever("trainer.global_batch_size", 64, "why", "effect")]
    plain = gated(recs, context({"lightning_module": False, "automatic_optimization": True}), finding)
    assert [r.key for r in plain] == ["optimizer.lr", "trainer.global_batch_size"]
    lit = gated(recs, context({"lightning_module": True, "automatic_optimization": False}), finding)
    assert [r.key for r in lit if r.key] == []
    assert "configure_optimizers" in lit[0].why and "optimizes manually" in lit[1].why


def test_a_sample_runs_summary_speaks_samples_not_tokens() -> None:
    summary = Summary(world_size=2, device="cpu", steps_recorded=10, tokens_per_s=500.0, work_unit="sample")
    summary.samples_per_s, summary.flops_per_token = 500.0, 2e6
    out = summary.to_json()
    assert out["samples_per_s"] == 500.0 and out["flops_per_sample"] == 2e6
    assert "tokens_per_s" not in out and "flops_per_token" not in out
    assert summary.rate_label == "samples/s"
    summary.tokens_per_sample = 32  # a module that says what a token is: its tokens/s follow from its samples/s
    assert summary.to_json()["tokens_per_s"] == 16_000.0
    token = Summary(world_size=2, device="cpu", steps_recorded=10, tokens_per_s=500.0)
    assert token.to_json()["tokens_per_s"] == 500.0 and token.rate_label == "tokens/s"


def test_a_model_yaml_in_the_users_own_config_dir_with_a_nested_net(tmp_path: Path) -> None:
    """lightning-hydra-template's layout: ``configs/model/<name>.yaml`` with ``_target_`` and a nested ``net``,
    found through ``hydra.searchpath``; an option in neither dir is still refused in one line."""
    from disttrain.job.preflight import preflight

    (tmp_path / "model").mkdir()
    (tmp_path / "data").mkdir()
    (tmp_path / "model" / "digits-convnet.yaml").write_text(
        f"_target_: {CLASSIFIER}.LitClassifier\nlr: 0.02\nnet:\n  _target_: {CLASSIFIER}.ConvNet\n  channels: 4\n"
    )
    (tmp_path / "data" / "digits.yaml").write_text(f"_target_: {CLASSIFIER}.DigitsData\nnoise: 0.5\n")
    search = f"hydra.searchpath=[file://{tmp_path}]"
    checked = preflight([search, "model=digits-convnet", "data=digits", "dry_run=true"], CONF)
    assert checked.prepared is not None
    model = checked.prepared.run_cfg.model
    assert isinstance(model, LightningModuleConfig) and model.target == f"{CLASSIFIER}.LitClassifier"
    assert model.kwargs == {"lr": 0.02, "net": {"_target_": f"{CLASSIFIER}.ConvNet", "channels": 4}}
    assert build_lightning_module(model).net.conv1.out_channels == 4
    with pytest.raises(ConfigError, match="unknown option 'digits-convnt'"):
        preflight([search, "model=digits-convnt", "data=digits"], CONF)


class NoTrainLoader(pl.LightningDataModule):
    def val_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(torch.zeros(4, 1)))


def test_a_datamodule_without_train_dataloader_is_refused_before_it_is_built() -> None:
    from disttrain.data.user_datamodule import check_user_datamodule

    with pytest.raises(ConfigError) as err:
        check_user_datamodule(CustomDataConfig(f"{__name__}.NoTrainLoader"), 16, None)
    assert err.value.key == "data._target_" and "has no train_dataloader()" in err.value.problem
    check_user_datamodule(CustomDataConfig(f"{CLASSIFIER}.DigitsData"), 16, None)  # binds batch_size=16
    with pytest.raises(ConfigError, match="does not fit its signature"):
        check_user_datamodule(CustomDataConfig(f"{CLASSIFIER}.DigitsData", kwargs={"bogus": 1}), 16, None)


class TrainOnly(pl.LightningDataModule):
    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(torch.arange(8)), batch_size=2)


def test_only_the_loader_hooks_a_datamodule_defines_are_wrapped() -> None:
    from lightning.pytorch.utilities.model_helpers import is_overridden

    from disttrain.data.user_loaders import shard_user_loaders

    data = TrainOnly()
    shard_user_loaders(data, rank=1, world=2, seed=0, global_batch=4)
    assert not is_overridden("val_dataloader", data)  # Lightning would call the base's "must be implemented"
    assert [b[0].tolist() for b in data.train_dataloader()] == [[1, 3], [5, 7]]


class Towers(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.towers = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
        self.head = nn.Sequential(nn.ReLU(), nn.Linear(4, 1))
        self.act = nn.ReLU()  # no parameters: nothing to compile


def test_model_compile_compiles_each_top_level_submodule_in_place_before_the_strategys_plan() -> None:
    module = Towers()
    keys = list(module.state_dict())
    order: list[str] = []

    def plan(m: nn.Module, mesh: object) -> None:
        order.append("plan" if is_compiled(m.head) else "plan before compile")

    with_compile_first(plan)(module, None)
    assert order == ["plan"]
    assert [is_compiled(m) for m in (*module.towers, module.head)] == [True, True, True]  # into the ModuleList
    # No parameters, the LightningModule itself, a compiled Sequential's members: not compiled on their own
    assert not any(is_compiled(m) for m in (module.act, module, module.head[0], module.head[1]))
    # The forward is compiled, the module's hooks are not: they stay outside the graph (FSDP2's, ZeRO-3's)
    assert module.towers[0]._compiled_call_impl is None
    assert list(module.state_dict()) == keys  # in place: checkpoints and exports keep the module's own names
    assert compile_submodules(Towers()) == ["towers.0", "towers.1", "head"]


class Head(nn.Module):
    """A forward of the user's own: dynamo does not trace a bare torch.nn layer as the top frame."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


class CompiledHead(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(6, 6)
        self.head = Head()
        self.head.compile(backend="eager")  # dynamo without inductor: the same rule, no C++ build

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.head(torch.relu(self.body(x))), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_module_with_compiled_code_is_counted_on_its_second_micro_batch_and_stays_compiled(tmp_path: Path) -> None:
    """A first call under FlopCounterMode (a dispatch mode) would leave the compiled code eager for good."""
    from torch._dynamo.utils import counters

    from disttrain.training.flop_count import holds_compiled_code

    assert holds_compiled_code(CompiledHead()) and not holds_compiled_code(Blocky())
    counters.clear()
    module, counted = CompiledHead(), FirstStepFlops()
    data = TensorDataset(torch.randn(12, 6), torch.randint(0, 2, (12,)))
    trainer = pl.Trainer(
        max_steps=3, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[counted], default_root_dir=str(tmp_path),
    )  # fmt: skip
    trainer.fit(module, DataLoader(data, batch_size=4))
    assert counters["stats"]["unique_graphs"] >= 1  # the head was compiled, not left eager
    # per sample: forward 2 x (36 + 12); backward the weight gradients of both (2 x 48) and the head's input's (24)
    assert counted.flops_per_sample == pytest.approx(2 * 48 + 2 * 48 + 2 * 12)


class TooBigForTheHost(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        raise RuntimeError(
            "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you tried to "
            "allocate 25600000000 bytes. Error code 12 (Cannot allocate memory)"
        )


def test_a_module_too_big_for_the_host_is_told_so_not_to_fix_its_keys() -> None:
    with pytest.raises(ConfigError) as err:
        build_lightning_module(LightningModuleConfig(f"{__name__}.TooBigForTheHost"))
    message = str(err.value)
    assert err.value.key == "model._target_" and "can't allocate memory" in message
    assert "does not fit this host's memory" in message and "python -m plan" in message
    assert "give model the keys" not in message
