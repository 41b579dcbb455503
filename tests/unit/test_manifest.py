"""run.json's schema (diagnostics.manifest.RunManifest): what the run writes is what the analysis reads."""

from __future__ import annotations

import json
from pathlib import Path

from diagnostics.analysis.load import load_run
from diagnostics.manifest import RunManifest, read_manifest
from disttrain.config.validate import BatchPlan, WorldLayout
from tests.conftest import hw_profile
from tests.diag_fixtures import write_run


def _running(world: WorldLayout) -> RunManifest:
    manifest = RunManifest(command=["python", "-m", "train", "trainer.max_steps=5"], config={"precision": "32"})
    manifest.world, manifest.hw = world, hw_profile("cpu")
    manifest.batch = BatchPlan(global_batch_size=16, micro_batch_size=4, data_parallel_size=2, accumulation=2)
    manifest.flops_per_token = 1.5e6
    return manifest


def test_the_writers_dataclasses_read_back_as_the_same_fields(tmp_path: Path) -> None:
    world = WorldLayout(num_nodes=1, devices_per_node=2, world_size=2, data_parallel_size=2)
    _running(world).write(tmp_path)
    data = json.loads((tmp_path / "run.json").read_text())
    assert data["world"] == {"num_nodes": 1, "devices_per_node": 2, "world_size": 2, "data_parallel_size": 2}
    assert data["batch"]["global_batch_size"] == 16 and data["hw"]["name"] == "cpu"
    # Outcome fields are absent until the run sets them: a reader tells "not yet" from "none".
    assert not {"failure", "failed_rank", "hung_ranks", "prediction", "result"} & set(data)
    manifest, problem = read_manifest(tmp_path)
    assert problem is None and manifest is not None
    assert manifest.world_size == 2 and manifest.flops_per_token == 1.5e6 and manifest.status == "running"
    assert manifest.command[-1] == "trainer.max_steps=5" and manifest.recorded


def test_marking_failed_is_a_copy_and_keeps_the_rest(tmp_path: Path) -> None:
    running = _running(WorldLayout(num_nodes=1, devices_per_node=2, world_size=2, data_parallel_size=2))
    running.failed("rank 1 hung: no step completed", 1, hung_ranks=[1]).write(tmp_path)
    assert running.status == "running" and running.failure is None
    back, _ = read_manifest(tmp_path)
    assert back is not None
    assert (back.status, back.failure, back.failed_rank, back.hung_ranks) == (
        "failed",
        "rank 1 hung: no step completed",
        1,
        [1],
    )
    assert back.config == {"precision": "32"}


def test_reading_is_tolerant_and_keeps_unknown_fields(tmp_path: Path) -> None:
    # A newer writer's field survives a rewrite; a field of the wrong type reads as unknown instead of failing.
    data = {"status": "completed", "failed_rank": "one", "world": {"world_size": "2"}, "attempts_world": [2, 1]}
    (tmp_path / "run.json").write_text(json.dumps(data))
    manifest, _ = read_manifest(tmp_path)
    assert manifest is not None
    assert manifest.failed_rank is None and manifest.world_size is None and manifest.status == "completed"
    manifest.write(tmp_path)
    assert json.loads((tmp_path / "run.json").read_text())["attempts_world"] == [2, 1]


def test_a_missing_or_broken_run_json_says_why(tmp_path: Path) -> None:
    assert read_manifest(tmp_path)[0] is None and "no run.json" in (read_manifest(tmp_path)[1] or "")
    (tmp_path / "run.json").write_text("[1, 2]")
    assert read_manifest(tmp_path) == (None, "run.json is not a JSON object")


def test_the_analysis_reads_the_manifest_through_the_schema(tmp_path: Path) -> None:
    run = load_run(write_run(tmp_path / "run", "input_bound"))
    assert isinstance(run.manifest, RunManifest)
    assert run.world_size == 2 and run.manifest.recorded
