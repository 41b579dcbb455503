"""DeepSpeed ZeRO-Infinity (offload to NVMe): the config DeepSpeed gets, the refusals before launch, each run's own
swap folder and its cleanup, and the planner's memory and time for it, checked against the model's arithmetic. The
training itself needs a GPU and DeepSpeed's async I/O op: tests/gpu/test_deepspeed_gpu.py."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest

from disttrain.config.errors import ConfigError
from disttrain.config.parse import parse_run_config
from disttrain.config.strategy_schema import DeepSpeedConfig
from disttrain.planner.terms.deepspeed import (
    NVME_OPTIMIZER_BUFFERS,
    NVME_PARAM_BUFFER_ELEMENTS,
    NVME_PARAM_BUFFERS,
    NVME_SUB_GROUP,
)
from disttrain.strategies.auto import check_fits, predict_memory
from disttrain.strategies.deepspeed import deepspeed_arch_list, deepspeed_config, remove_swap_files
from disttrain.strategies.deepspeed_spec import nvme_swap_folder, with_run_swap_folder
from disttrain.strategies.layout import parallel_layout, validate_run
from tests.conftest import compose_train

GPU = ["strategy=deepspeed", "hw=8xa100", "precision=bf16-mixed", "model=llama-7b", "trainer.micro_batch_size=1"]


def run_config(overrides: list[str]):
    return parse_run_config(compose_train([*GPU, *overrides]))


def test_offload_to_nvme_reaches_deepspeed_with_its_path_and_smaller_sub_groups() -> None:
    cfg = DeepSpeedConfig(stage=3, offload_optimizer="nvme", offload_params="nvme", nvme_path="/nvme/run")
    zero = deepspeed_config(cfg, 2)["zero_optimization"]
    assert zero["offload_optimizer"] == {"device": "nvme", "pin_memory": True, "nvme_path": "/nvme/run"}
    assert zero["offload_param"] == {"device": "nvme", "pin_memory": True, "nvme_path": "/nvme/run"}
    assert zero["sub_group_size"] == NVME_SUB_GROUP
    # true still means the host, and host offload keeps DeepSpeed's own sub-groups.
    host = deepspeed_config(DeepSpeedConfig(stage=3, offload_optimizer=True, offload_params="cpu"), 2)
    assert host["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert host["zero_optimization"]["offload_param"] == {"device": "cpu", "pin_memory": True}
    assert "sub_group_size" not in host["zero_optimization"]


NVME_OPT = ["strategy.stage=3", "strategy.offload_optimizer=nvme"]


@pytest.mark.parametrize(
    ("overrides", "key", "words"),
    [
        (["strategy.offload_optimizer=nvme", "strategy.nvme_path=/tmp"], "strategy.offload_optimizer", "stage 2"),
        (["strategy.stage=3", "strategy.offload_params=nvme"], "strategy.nvme_path", "directory"),
        (["strategy.stage=3", "strategy.offload_optimizer=disk"], "strategy.offload_optimizer", "offload device"),
        (["strategy.nvme_path=/tmp"], "strategy.nvme_path", "nothing is offloaded"),
        ([*NVME_OPT, "strategy.nvme_path=/etc/hostname/x"], "strategy.nvme_path", "writable"),
        (["hw=cpu", *NVME_OPT, "strategy.nvme_path=/tmp"], "strategy.offload_optimizer", "GPUs"),
    ],
)
def test_offload_to_nvme_is_refused_before_launch_with_the_key(overrides: list[str], key: str, words: str) -> None:
    with pytest.raises(ConfigError) as info:
        validate_run(run_config(overrides))
    assert info.value.key == key and words in str(info.value)


def test_each_run_swaps_in_its_own_folder(tmp_path: Path) -> None:
    base = ["strategy.stage=3", "strategy.offload_optimizer=nvme", f"strategy.nvme_path={tmp_path}"]
    cfg = run_config(base)
    validate_run(cfg)
    first, second = tmp_path / "runs" / "12-00-00", tmp_path / "runs" / "12-00-00_1"
    mine = with_run_swap_folder(cfg, first).strategy.nvme_path
    assert mine == str(nvme_swap_folder(str(tmp_path), first)) and Path(mine).parent == tmp_path
    assert mine == str(nvme_swap_folder(str(tmp_path), first))  # every rank of the run names the same folder
    assert mine != str(nvme_swap_folder(str(tmp_path), second))
    host = run_config(["strategy.stage=3", "strategy.offload_optimizer=cpu"])
    assert with_run_swap_folder(host, first) is host


def test_a_rank_removes_only_its_own_swap_files(tmp_path: Path) -> None:
    run = tmp_path / "disttrain-run"
    for rank in (0, 1):
        for kind in ("optimizer", "bfloat16params"):
            folder = run / "zero_stage_3" / kind / f"rank{rank}"
            folder.mkdir(parents=True)
            (folder / "swap.tensor").write_bytes(b"x" * 64)
    neighbour = tmp_path / "someone-else" / "data.bin"
    neighbour.parent.mkdir()
    neighbour.write_bytes(b"keep")
    remove_swap_files(run, 0)
    assert not list(run.glob("zero_stage_3/*/rank0")) and len(list(run.glob("zero_stage_3/*/rank1"))) == 2
    remove_swap_files(run, 1)
    assert not run.exists() and neighbour.read_bytes() == b"keep"


@pytest.mark.parametrize(
    ("given", "built"),
    [("9.0a", "9.0"), ("8.0;9.0a+PTX", "8.0;9.0+PTX"), ("7.5 8.0", "7.5;8.0"), ("9.0a;9.0", "9.0"), ("10.0a", "10.0")],
)
def test_arch_list_is_what_deepspeeds_jit_builder_parses(given: str, built: str) -> None:
    assert deepspeed_arch_list(given) == built
    for entry in built.split(";"):
        [int(part.split("+")[0]) for part in entry.split(".")]  # DeepSpeed's own parse (op_builder/builder.py)


def test_planner_moves_the_swapped_states_from_host_memory_to_nvme() -> None:
    def predicted(offload: str):
        where = [f"strategy.offload_optimizer={offload}", f"strategy.offload_params={offload}"]
        path = ["strategy.nvme_path=/tmp"] if offload == "nvme" else []
        cfg = run_config(["strategy.stage=3", *where, *path])
        return predict_memory(cfg, parallel_layout(cfg))

    host, nvme = predicted("cpu"), predicted("nvme")
    assert host is not None and nvme is not None
    n = 6_738_415_616  # llama-7b's parameters (the planner's shape of conf/model/llama-7b.yaml)
    shard = math.ceil(n / 8)
    assert nvme.total == host.total  # what stays on the GPU does not change
    assert nvme.nvme == 12 * shard + 2 * shard  # fp32 master, momentum, variance; the bf16 parameter partition
    buffers = NVME_OPTIMIZER_BUFFERS * 4 * NVME_SUB_GROUP + NVME_PARAM_BUFFERS * 2 * NVME_PARAM_BUFFER_ELEMENTS
    assert host.host - nvme.host == 12 * shard + 2 * shard - buffers
    assert host.nvme == 0


def test_planner_times_the_nvme_swaps_at_the_nodes_shared_bandwidth() -> None:
    from disttrain.config.hf import reference_shape
    from disttrain.planner import Layout
    from disttrain.planner.comm import comm_plan
    from disttrain.planner.plan import DEFAULT_ASSUMPTIONS
    from disttrain.planner.shapes import model_shape
    from disttrain.planner.step_time import estimate_step
    from disttrain.strategies.auto import workload
    from disttrain.strategies.layout import batch_plan
    from disttrain.strategies.registry import spec_of

    cfg = run_config([*NVME_OPT, "strategy.offload_params=nvme", "strategy.nvme_path=/tmp"])
    layout = spec_of(cfg.strategy).planner_layout(8, 1)
    assert isinstance(layout, Layout) and layout.nvme_optimizer and layout.nvme_params
    assert "opt->nvme" in layout.label() and layout.options()["offload_optimizer"] == "nvme"
    shape = model_shape(reference_shape(cfg.model))
    work = workload(cfg, batch_plan(cfg))
    traffic = comm_plan(shape, layout, work, cfg.hw)
    estimate = estimate_step(shape, layout, work, cfg.hw, traffic, DEFAULT_ASSUMPTIONS)
    shard = math.ceil(shape.num_parameters / 8)
    # Optimizer states in and out (2 x 12 bytes), the parameter partition written after the step and read for
    # forward and backward (3 x 2 bytes), by the node's 8 GPUs over one node's 6 GB/s.
    assert estimate.nvme_s == pytest.approx((24 + 6) * shard * 8 / 6e9)
    assert estimate.step_time_s > estimate.nvme_s > 0


def test_memory_check_refuses_swap_files_larger_than_the_drives_free_space(tmp_path: Path, monkeypatch) -> None:
    cfg = run_config(["strategy.stage=3", "strategy.offload_optimizer=nvme", f"strategy.nvme_path={tmp_path}"])
    memory = predict_memory(cfg, parallel_layout(cfg))
    assert memory is not None and memory.nvme > 0
    real = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: real._replace(free=memory.nvme * 8 - 1))
    with pytest.raises(ConfigError) as info:
        check_fits(cfg, memory, check_memory=True)
    assert info.value.key == "strategy.nvme_path" and "per node" in info.value.problem
    monkeypatch.setattr(shutil, "disk_usage", lambda path: real._replace(free=memory.nvme * 8))
    check_fits(cfg, memory, check_memory=True)  # exactly enough room
    monkeypatch.setattr(shutil, "disk_usage", lambda path: real._replace(free=0))
    check_fits(cfg, memory, check_memory=False)  # check_memory=false launches anyway


def test_parameter_swap_buffers_fit_the_largest_parameters_partition() -> None:
    """DeepSpeed asserts, after launch, that each parameter's partition fits one offload_param buffer (1e8 elements
    by default): llama-1b's 128256 x 2048 embedding on one GPU is 262M. The buffer follows the model's shape."""
    from disttrain.strategies.deepspeed_spec import nvme_param_buffer

    one_gpu = ["hw.devices_per_node=1", "model=llama-1b", "strategy.stage=3", "strategy.offload_params=nvme"]
    cfg = run_config([*one_gpu, "strategy.nvme_path=/tmp"])
    buffer = nvme_param_buffer(cfg, 1)
    assert buffer == 128256 * 2048  # the largest leaf module's parameters, whole on one rank
    zero = deepspeed_config(cfg.strategy, 1, buffer)["zero_optimization"]
    assert zero["offload_param"]["buffer_size"] == buffer
    memory = predict_memory(cfg, parallel_layout(cfg))
    assert memory is not None
    host = run_config([*one_gpu[:-1], "strategy.offload_params=cpu"])
    on_host = predict_memory(host, parallel_layout(host))
    assert on_host is not None
    # The parameter partition leaves the host for the drive; 5 pinned bf16 buffers of that size take its place.
    assert on_host.host - memory.host == memory.nvme - NVME_PARAM_BUFFERS * 2 * buffer
    # Eight ranks of llama-7b: each partition fits DeepSpeed's own default, which stays.
    assert nvme_param_buffer(run_config([*NVME_OPT, "strategy.offload_params=nvme", "strategy.nvme_path=/tmp"]), 8) == (
        NVME_PARAM_BUFFER_ELEMENTS
    )
    assert nvme_param_buffer(run_config(["strategy.stage=3"]), 8) is None  # nothing swapped to NVMe
