"""model.compile_mode: validated before launch, decided for where CUDA graphs were measured to pay (one GPU, DDP,
dense), and each forward of a graphed model starting a new graph generation (validation's no-grad graphs read no
output a later replay overwrote: the H200 run that crashed in its first validation before this)."""

from __future__ import annotations

import pytest
import torch

from disttrain.config.errors import ConfigError
from disttrain.config.parse import parse_run_config
from disttrain.strategies.layout import validate_run
from tests.conftest import compose_train

ONE_GPU = ["hw=8xh200", "hw.devices_per_node=1", "model=gpt2-124m", "precision=bf16-mixed"]


def decided(overrides: list[str]) -> tuple[object, object]:
    model = parse_run_config(compose_train(overrides)).model
    return model.compile, model.compile_mode


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (ONE_GPU, (True, "reduce-overhead")),  # measured: 36.9 ms against 44.1 ms a step on an H200
        ([*ONE_GPU, "model.compile_mode=default"], (True, "default")),  # the user's choice stands
        ([*ONE_GPU, "hw.devices_per_node=8"], (True, None)),  # several ranks: not measured with graphs
        ([*ONE_GPU, "strategy=fsdp"], (True, None)),  # FSDP gathers parameters into new memory each step
        ([*ONE_GPU, "precision=fp8"], (True, "reduce-overhead")),  # measured on llama-1b: 77.7k against 74.4k
        ([*ONE_GPU, "precision=fp16-mixed"], (True, None)),  # bf16-mixed and fp8 were measured with graphs
        ([*ONE_GPU, "model=moe-micro"], (True, None)),
        ([*ONE_GPU, "model.compile=false"], (False, None)),
        (["model=gpt2-124m"], (False, None)),  # CPU: nothing compiled unless asked
    ],
)
def test_cuda_graphs_are_decided_for_one_gpu_ddp_dense_runs(overrides: list[str], expected: tuple) -> None:
    assert decided(overrides) == expected


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        (["model.compile_mode=fast"], "is not one of"),
        (["model.compile_mode=reduce-overhead"], "model.compile is off"),  # CPU: compile is off unless set
        ([*ONE_GPU, "strategy=fsdp", "model.compile_mode=reduce-overhead"], "strategy=ddp only"),
        ([*ONE_GPU, "model=moe-micro", "model.compile_mode=max-autotune"], "varying number of tokens"),
    ],
)
def test_compile_mode_is_refused_before_launch_with_the_key(overrides: list[str], words: str) -> None:
    with pytest.raises(ConfigError) as info:
        validate_run(parse_run_config(compose_train(overrides)))
    assert info.value.key == "model.compile_mode" and words in str(info.value)


def test_every_model_preset_that_compiles_takes_a_compile_mode() -> None:
    from tests.conftest import CONF

    for preset in sorted((CONF / "model").glob("*.yaml")):
        text = preset.read_text()
        if "\ncompile: null" in text:
            assert "\ncompile_mode: null" in text, preset.name


def test_each_forward_of_a_graphed_model_starts_a_new_graph_generation(monkeypatch) -> None:
    from disttrain.config.schema import OptimizerConfig
    from disttrain.models.module import LanguageModelModule

    marks: list[int] = []
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(1))
    for graphed, expected in ((True, 2), (False, 0)):
        marks.clear()
        module = LanguageModelModule(lambda: torch.nn.Identity(), OptimizerConfig(), 10, cudagraphs=graphed)
        module.configure_model()
        tokens = torch.zeros(2, 4)
        module(tokens)
        module(tokens)
        assert len(marks) == expected
