"""Planner speed: a 1T-parameter model over 1024 GPUs, and the CLI end to end.

Prints the planning time (best and median of several runs), the import time of the planner and the wall time of
``python -m plan ... output=json`` in a subprocess. The target is "well under a second"; nothing is asserted here
(timings belong in benchmarks, not tests).

    python benchmarks/plan_speed.py
    python benchmarks/plan_speed.py --repeat 20
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import subprocess
import sys
import time
from pathlib import Path

from omegaconf import OmegaConf

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=10)
    args = parser.parse_args()

    started = time.perf_counter()
    from disttrain.config.hardware import HardwareProfile
    from disttrain.config.schema import ModelConfig
    from disttrain.planner import plan

    import_s = time.perf_counter() - started
    # Narayanan et al. 2021's 1T GPT (128 layers, hidden 25600, 160 heads) on 128 nodes x 8 A100.
    model = ModelConfig(
        name="gpt-1t",
        n_layers=128,
        d_model=25600,
        n_heads=160,
        ffn_hidden=102400,
        vocab_size=51200,
        seq_len=2048,
        pos_emb="learned",
    )
    node = HardwareProfile(**OmegaConf.to_container(OmegaConf.load(REPO / "conf" / "hw" / "8xa100.yaml")))
    cluster = dataclasses.replace(node, name="128x8xa100", num_nodes=128)
    times = []
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        result = plan(model, cluster, micro_batch_size=1, global_batch_size=3072)
        times.append(time.perf_counter() - t0)
    best = result.recommended
    print(f"planner import: {import_s * 1e3:.0f} ms (torch not imported: {'torch' not in sys.modules})")
    print(
        f"plan 1T params ({result.shape.num_parameters:,}) over {cluster.world_size} GPUs: "
        f"{len(result.candidates)} candidates in {min(times) * 1e3:.1f} ms best, "
        f"{statistics.median(times) * 1e3:.1f} ms median of {args.repeat}"
    )
    if best is not None:
        print(f"  recommended: {best.label}, {best.step_time_s:.1f} s/step, MFU {best.mfu:.1%}")

    command = [sys.executable, "-m", "plan", "model=llama-70b", "hw=2x8xh100", "output=json"]
    t0 = time.perf_counter()
    subprocess.run(command, check=True, capture_output=True, cwd=REPO)
    print(f"python -m plan model=llama-70b hw=2x8xh100 output=json: {time.perf_counter() - t0:.2f} s wall")


if __name__ == "__main__":
    main()
