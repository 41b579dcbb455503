"""Comm-hook pieces without a process group: the collective-bytes parser and PowerSGD's per-parameter state."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from diagnostics.collect.comm_bytes import collective_bytes, profiler_options
from disttrain.config.parse import parse_run_config
from disttrain.strategies.powersgd import PowerSGDComm, state_path
from disttrain.training.build import collectives_off_thread
from tests.conftest import compose_train


def _gloo(op: str, dims: list, types: list) -> dict:
    args = {"Input Dims": dims, "Input type": types}
    return {"ph": "X", "name": f"gloo:{op}", "cat": "user_annotation", "args": args}


def test_gloo_payload_is_shape_times_dtype_size() -> None:
    trace = {
        "traceEvents": [
            _gloo("all_reduce", [[1000]], ["float"]),
            _gloo("all_reduce", [[10, 30]], ["c10::BFloat16"]),
            _gloo("all_reduce", [[7]], ["c10::Half"]),
            _gloo("all_gather", [[3]], ["double"]),
            _gloo("barrier", [], []),
            # c10d:: dispatcher events repeat the gloo ones (without a dtype): not counted twice
            {"ph": "X", "name": "c10d::allreduce_", "cat": "cpu_op", "args": {"Input Dims": [[[1000]]]}},
        ]
    }
    assert collective_bytes(trace) == {"all_reduce": 4000 + 600 + 14, "all_gather": 24}


def test_nccl_payload_comes_from_the_host_event_only() -> None:
    args = {"Collective name": "allreduce", "In msg nelems": 256, "dtype": "BFloat16"}
    trace = {
        "traceEvents": [
            {"ph": "X", "name": "record_param_comms", "cat": "cpu_op", "args": args},
            {"ph": "X", "name": "ncclDevKernel_AllReduce", "cat": "kernel", "args": args},
            {"ph": "X", "name": "record_param_comms", "cat": "kernel", "args": args},
        ]
    }
    assert collective_bytes(trace) == {"allreduce": 512}


def test_profiler_records_shapes_on_all_threads() -> None:
    options = profiler_options()
    assert options["record_shapes"] is True
    assert "experimental_config" in options  # torch 2.13 has profile_all_threads
    assert profiler_options(all_threads=False) == {"record_shapes": True}


@pytest.mark.parametrize(("hook", "off_thread"), [("none", False), ("bf16", False), ("powersgd", True)])
def test_only_powersgd_runs_profile_every_thread(hook: str, off_thread: bool) -> None:
    """PowerSGD issues all-reduces from gloo's future callbacks: only its runs need the all-thread profiler."""
    cfg = parse_run_config(compose_train(["strategy=ddp", f"strategy.comm_hook={hook}"]))
    assert collectives_off_thread(cfg) is off_thread


def _comm_with_state() -> PowerSGDComm:
    comm = PowerSGDComm(rank=2, warmup_steps=2, error_feedback=True)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 8))
    comm.bind_names(model)
    comm.state.iter = 7
    comm.state.rng.randint(1000)  # advance, so the restored stream is not the seed's
    names = ("1.bias", "1.weight", "0.bias", "0.weight")
    comm.layouts[0] = names
    numel = 8 + 8 * 32 + 32 + 32 * 16
    comm.state.error_dict[0] = torch.arange(numel, dtype=torch.float32)
    # Compressed matrices in torch's order (grouped by shape): 1.weight is 8x32, 0.weight is 32x16; Q is cols x rank.
    comm.state.q_memory_dict[0] = torch.arange(32 * 2 + 16 * 2, dtype=torch.float32)
    comm.state.p_memory_dict[0] = torch.zeros(8 * 2 + 32 * 2)
    return comm


def test_state_is_saved_per_parameter() -> None:
    saved = _comm_with_state().state_dict(world_size=2)
    assert saved["iter"] == 7 and saved["world_size"] == 2
    assert torch.equal(saved["error"]["1.bias"], torch.arange(8.0))
    assert torch.equal(saved["error"]["0.weight"], torch.arange(8 + 256 + 32, 8 + 256 + 32 + 512.0))
    assert sorted(saved["q"]) == ["0.weight", "1.weight"]
    assert torch.equal(saved["q"]["1.weight"], torch.arange(64.0).reshape(32, 2))
    assert torch.equal(saved["q"]["0.weight"], torch.arange(64, 96.0).reshape(16, 2))


def test_restored_state_goes_into_whatever_buckets_come_next() -> None:
    original = _comm_with_state()
    saved = original.state_dict(world_size=2)
    fresh = PowerSGDComm(rank=2, warmup_steps=2, error_feedback=True)
    fresh.bind_names(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 8)))
    assert fresh.load_state_dict(saved, world_size=2) == []
    assert fresh.state.iter == 7
    assert fresh.state.rng.randint(10**9) == original.state.rng.randint(10**9)
    # A different grouping: the two layers in separate buckets, in the other order.
    like = torch.empty(0)
    fresh._pack(0, ("0.bias", "0.weight"), like)
    fresh._pack(1, ("1.bias", "1.weight"), like)
    assert torch.equal(fresh.state.error_dict[1], torch.arange(8 + 256.0))
    assert torch.equal(fresh.state.q_memory_dict[0], torch.arange(64, 96.0))
    assert fresh.state.p_memory_dict[0].numel() == 32 * 2 and fresh.state.p_memory_dict[1].numel() == 8 * 2
    assert fresh.pending == {"error": {}, "q": {}}


def test_other_world_size_drops_only_the_error_feedback() -> None:
    saved = _comm_with_state().state_dict(world_size=2)
    fresh = PowerSGDComm(rank=2, warmup_steps=2, error_feedback=True)
    dropped = fresh.load_state_dict(saved, world_size=4)
    assert dropped == ["error feedback (saved by 2 ranks, now 4)"]
    assert fresh.pending["error"] == {} and sorted(fresh.pending["q"]) == ["0.weight", "1.weight"]
    other_rank = PowerSGDComm(rank=4, warmup_steps=2, error_feedback=True)
    assert "warm-start factors" in other_rank.load_state_dict(saved, world_size=2)[0]


def test_state_survives_torch_save_with_weights_only(tmp_path) -> None:
    saved = _comm_with_state().state_dict(world_size=2)
    path = state_path(tmp_path / "checkpoints" / "step000010.ckpt", rank=1)
    assert path == tmp_path / "checkpoints" / "step000010.powersgd" / "rank00001.pt"
    path.parent.mkdir(parents=True)
    torch.save(saved, path)
    loaded = torch.load(path, weights_only=True)
    assert loaded["iter"] == 7 and isinstance(loaded["rng"]["keys"], torch.Tensor)
    assert np.array_equal(loaded["rng"]["keys"].numpy(), saved["rng"]["keys"].numpy())
