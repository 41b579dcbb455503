"""Export a ``model=hf`` run's weights in Hugging Face format (config.json + model.safetensors).

Works from any strategy's checkpoint, after the ranks are gone: a single file (DDP), a torch.distributed.checkpoint
directory (FSDP2) or DeepSpeed's per-rank directory (ZeRO partitions merged by Lightning's converter). The
weights are loaded into the configured model and written with ``save_pretrained``, so ``from_pretrained`` on the
directory gives the trained model (tied embeddings stay tied).
"""

from __future__ import annotations

import contextlib
import io
import tempfile
from pathlib import Path

import torch

from disttrain.config.schema import HFModelConfig

HF_PREFIX = "model.hf."  # the LightningModule holds the wrapper as `model`, the wrapper the HF model as `hf`


def checkpoint_state(checkpoint: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the LightningModule's state dict in a checkpoint, whatever strategy wrote it."""
    if checkpoint.is_dir():
        with tempfile.TemporaryDirectory() as tmp:
            merged = Path(tmp) / "merged.pt"
            if (checkpoint / ".metadata").exists():
                from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

                dcp_to_torch_save(checkpoint, merged)
            else:
                from lightning.pytorch.utilities.deepspeed import convert_zero_checkpoint_to_fp32_state_dict

                # DeepSpeed's converter prints its progress: keep the run's console to the run's own lines.
                with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                    convert_zero_checkpoint_to_fp32_state_dict(str(checkpoint), str(merged))
            state = torch.load(merged, map_location="cpu", weights_only=False)
    else:
        state = torch.load(checkpoint, map_location="cpu", weights_only=True)
    weights = state.get("state_dict", state)
    return {k: v for k, v in weights.items() if isinstance(v, torch.Tensor)}


def hf_weights(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The HF model's own parameter names: everything after ``model.hf.``, wrapper segments removed."""
    out = {}
    for key, value in state.items():
        if HF_PREFIX in key:
            out[key.split(HF_PREFIX, 1)[1].replace("_checkpoint_wrapped_module.", "")] = value
    return out


def export_hf(checkpoint: Path, model: HFModelConfig, out_dir: Path, seed: int = 0) -> Path:
    """Write the checkpoint's weights as a ``from_pretrained``-loadable directory; returns ``out_dir``."""
    from disttrain.models.hf import build_hf_model

    wrapper = build_hf_model(model, seed)
    weights = hf_weights(checkpoint_state(checkpoint))
    missing, unexpected = wrapper.hf.load_state_dict(weights, strict=False)
    tied = {name for name, _ in wrapper.hf.named_parameters(remove_duplicate=False)} - set(
        dict(wrapper.hf.named_parameters())
    )
    if unexpected or set(missing) - tied:
        raise RuntimeError(
            f"checkpoint {checkpoint} does not hold this model: missing {sorted(set(missing) - tied)[:3]}, "
            f"unexpected {sorted(unexpected)[:3]}"
        )
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # its "Writing model shards" bar would interleave with the run's summary
    wrapper.save_pretrained(out_dir)
    return out_dir
