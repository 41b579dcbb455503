"""Peak host memory (MiB) of one rank while a ``model=hf`` model is built for ZeRO-3 or FSDP2: before (built whole, then
partitioned or sharded: the ``whole`` placement) vs now (``deferred``: ZeRO-3 one module at a time, FSDP2 only the
rank's shards), on 2 gloo ranks, from an inline config or a ``save_pretrained`` directory (``--path``).

Each (mode, strategy) is its own spawn. Figures, each minus the value before the build (imports done): the peak of
private memory (RssAnon, the tensors) during the build and what stays after it (the rank's partition or shards),
and the peak of mapped-file pages (RssFile: safetensors mappings, page cache shared by the node's ranks), sampled
every millisecond. Not run in CI.

    python benchmarks/hf_build_memory.py [--layers 8] [--hidden 768] [--vocab 32000] [--path]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp


def _rss_mib() -> dict[str, float]:
    """This process's resident memory: private (RssAnon: tensors) and file-backed (RssFile: mapped files)."""
    with open("/proc/self/status") as handle:
        fields = dict(line.split(":", 1) for line in handle)
    return {key: int(fields[key].split()[0]) / 1024 for key in ("RssAnon", "RssFile")}


class PeakSampler(threading.Thread):
    """The kernel keeps only the peak of the total RSS; this samples both parts every millisecond."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak = _rss_mib()
        self.running = True

    def run(self) -> None:
        while self.running:
            now = _rss_mib()
            self.peak = {key: max(self.peak[key], now[key]) for key in now}
            time.sleep(0.001)


def _rank(rank: int, port: int, strategy: str, placement: str, source: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2")  # fmt: skip
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    import deepspeed

    from disttrain.config.schema import HFModelConfig, PrecisionConfig
    from disttrain.config.strategy_schema import FSDPConfig
    from disttrain.models import apply_activation_checkpointing
    from disttrain.models.factory import build_model_factory
    from disttrain.strategies.deepspeed import disable_shm_comm_build, partition_model
    from disttrain.strategies.fsdp import apply_fsdp

    disable_shm_comm_build()
    deepspeed.init_distributed(dist_backend="gloo")
    model_cfg = HFModelConfig(seq_len=64, **json.loads(source))
    factory = build_model_factory(model_cfg, 0, placement)
    import transformers  # noqa: F401  (imported before the baseline, as the factory would)

    torch.distributed.barrier()
    before = _rss_mib()
    sampler = PeakSampler()
    sampler.start()
    model = factory()
    if strategy == "zero3":
        config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
        partition_model(model, config, None, rank)
    else:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("data_parallel",))
        apply_fsdp(model, mesh, FSDPConfig(), PrecisionConfig(), apply_activation_checkpointing)
    sampler.running = False
    sampler.join()
    after = _rss_mib()
    result = {key: {"peak": sampler.peak[key] - before[key], "kept": after[key] - before[key]} for key in before}
    Path(out, f"{strategy}-{placement}-{rank}.json").write_text(json.dumps(result))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    os._exit(0)  # skip the slow interpreter teardown; results are written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--path", action="store_true", help="load from a save_pretrained directory")
    args = parser.parse_args()
    config = {"model_type": "llama", "hidden_size": args.hidden, "intermediate_size": 8 * args.hidden // 3,
              "num_hidden_layers": args.layers, "num_attention_heads": 12, "num_key_value_heads": 4,
              "vocab_size": args.vocab, "max_position_embeddings": 256, "tie_word_embeddings": False}  # fmt: skip
    out = tempfile.mkdtemp()
    # Freed blocks go back to the OS at once (glibc would otherwise raise its mmap threshold after the first large
    # free and keep later ones in the heap): RSS then follows live tensors. Read by the spawned ranks at start-up.
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 20))
    source: dict = {"config": config}
    if args.path:
        from disttrain.config.schema import HFModelConfig
        from disttrain.models.hf import build_hf_model

        build_hf_model(HFModelConfig(config=config, seq_len=64), seed=0).save_pretrained(Path(out) / "model")
        source = {"path": str(Path(out) / "model")}
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(config)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(AutoConfig.for_model(fields.pop("model_type"), **fields))
    count = sum(p.numel() for p in meta.parameters())
    print(f"llama {args.layers} layers x {args.hidden}, vocab {args.vocab}: {count / 1e6:.1f}M parameters, "
          f"{count * 4 / 2**20:.0f} MiB fp32; source: {'model.path' if args.path else 'inline config'}")  # fmt: skip
    for strategy in ("zero3", "fsdp"):
        for placement in ("whole", "deferred"):
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            mp.spawn(_rank, args=(port, strategy, placement, json.dumps(source), out), nprocs=2, join=True)
            ranks = [json.loads(Path(out, f"{strategy}-{placement}-{r}.json").read_text()) for r in range(2)]
            peaks = "; ".join(
                f"rank {r}: anon +{x['RssAnon']['peak']:.0f} peak/+{x['RssAnon']['kept']:.0f} kept, "
                f"file +{x['RssFile']['peak']:.0f} peak"
                for r, x in enumerate(ranks)
            )
            print(f"{strategy:5s} {placement:8s} {peaks}")


if __name__ == "__main__":
    main()
