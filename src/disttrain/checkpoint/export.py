"""Export a checkpoint's weights as one file, and a ``model=hf`` run's in Hugging Face format.

Works from any checkpoint, after the ranks are gone, in one process: the universal layout is read model part only;
a pre-universal DDP file or DeepSpeed ZeRO dir is merged. ``export_state_dict`` writes one ``torch.save`` file under
the model's own parameter names; ``export_hf`` loads the weights into the configured HF model and writes it with
``save_pretrained``, so ``from_pretrained`` on the directory gives the trained model (tied embeddings stay tied).
"""

from __future__ import annotations

import contextlib
import io
import os
import tempfile
from pathlib import Path

import torch

from disttrain.checkpoint import universal
from disttrain.config.schema import HFModelConfig
from disttrain.models.hf import build_hf_model

MODEL_PREFIX = "model."  # the LightningModule holds the model as `model`
HF_PREFIX = "model.hf."  # the LightningModule holds the wrapper as `model`, the wrapper the HF model as `hf`


def checkpoint_state(checkpoint: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the LightningModule's state dict in a checkpoint (``model.<name>``), whatever wrote it.

    A universal checkpoint is read model part only (the optimizer state stays on disk) in this one process;
    checkpoints in a strategy's older own format (a DDP file, a DeepSpeed ZeRO dir) are merged as before."""
    if universal.is_universal(checkpoint):
        return universal.read_model(checkpoint)
    if checkpoint.is_dir():
        with tempfile.TemporaryDirectory() as tmp:
            merged = Path(tmp) / "merged.pt"
            from lightning.pytorch.utilities.deepspeed import convert_zero_checkpoint_to_fp32_state_dict

            # DeepSpeed's converter prints its progress: keep the console to our own lines.
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                convert_zero_checkpoint_to_fp32_state_dict(str(checkpoint), str(merged))
            state = torch.load(merged, map_location="cpu", weights_only=False)
    else:
        state = torch.load(checkpoint, map_location="cpu", weights_only=True)
    weights = state.get("state_dict", state)
    return {k: v for k, v in weights.items() if isinstance(v, torch.Tensor)}


def export_state_dict(checkpoint: Path, out: Path, prefix: str = MODEL_PREFIX) -> Path:
    """One ``torch.save`` file of the model's weights under the model's own names (``blocks.0.attn.wq.weight``):
    ``model.load_state_dict(torch.load(out))`` on the single-process model, whatever strategy trained it. A user's
    LightningModule is its own model (``prefix=""``): its names are its state dict's (``net.conv1.weight``)."""
    weights = {k.removeprefix(prefix): v for k, v in checkpoint_state(checkpoint).items()}
    return save_exclusively(weights, out)


def export_lightning_checkpoint(checkpoint: Path, out: Path) -> Path:
    """A user's LightningModule's weights with its saved hyper-parameters as a Lightning checkpoint file:
    ``YourModule.load_from_checkpoint(out)`` builds the trained module (arguments it did not save, such as a
    network passed in, are given to that call), whatever strategy and world size trained it."""
    saved = universal.read_meta(checkpoint) if universal.is_universal(checkpoint) else {}
    kept = {k: saved[k] for k in ("hyper_parameters", "hparams_name", "pytorch-lightning_version") if k in saved}
    return save_exclusively({"state_dict": checkpoint_state(checkpoint), **kept}, out)


def save_exclusively(payload: dict, out: Path) -> Path:
    """``torch.save(payload)`` to ``out``, which must not exist; a kill mid-write leaves no file there."""
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(f".{out.name}.{os.getpid()}.partial")  # its own: two exports never write one file
    try:
        torch.save(payload, partial)
        # A hard link is an exclusive create of the final name (FileExistsError if it exists, as another export
        # may have made it since the caller looked) and holds the whole file: a kill mid-write leaves no file there.
        os.link(partial, out)
    finally:
        partial.unlink(missing_ok=True)
    return out


def hf_weights(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The HF model's own parameter names: everything after ``model.hf.``, wrapper segments removed."""
    out = {}
    for key, value in state.items():
        if HF_PREFIX in key:
            out[key.split(HF_PREFIX, 1)[1].replace("_checkpoint_wrapped_module.", "")] = value
    return out


def export_hf(checkpoint: Path, model: HFModelConfig, out_dir: Path, seed: int = 0) -> Path:
    """Write the checkpoint's weights as a ``from_pretrained``-loadable directory; returns ``out_dir``."""
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
