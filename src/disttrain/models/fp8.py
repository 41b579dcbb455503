"""precision=fp8: torchao's float8 training applied to a model's linear layers before any parallel plan.

The swap must come before FSDP2 (with the tensorwise recipe torchao's weight subclass all-gathers in fp8) and
before ``torch.compile`` (the casts and scales fuse into the compiled blocks; eager fp8 spends what it saves on
separate cast kernels). Layers left in bf16, as torchtitan leaves them: the LM head (the logits feed a softmax
over the whole vocabulary, the layer most sensitive to fp8's 3 mantissa bits; ``precision.fp8_head=true`` converts
it too) and any layer whose dimensions are not multiples of 16 (fp8 matmul kernels need them).
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging

from torch import nn

from disttrain.config.schema import FP8_DIM_MULTIPLE

# Output heads by the names the reference model and Hugging Face models give them.
HEAD_NAMES = ("lm_head", "output", "embed_out")


def torchao_missing() -> str | None:
    """Why torchao's float8 training cannot be imported here, or None when it can."""
    if importlib.util.find_spec("torchao") is None:
        return "the torchao package is not installed"
    try:
        with quiet_torchao_import():
            from torchao.float8 import convert_to_float8_training  # noqa: F401
    except Exception as err:  # an incompatible torchao/torch pair fails in many ways
        return f"torchao.float8 does not import ({type(err).__name__}: {err})"
    return None


@contextlib.contextmanager
def quiet_torchao_import():
    """torchao logs a warning for each of its optional C++ kernels a CPU-only or other-version torch cannot load, and
    torch one for an enum torchao registers with pytree; float8 training needs neither, and the console is the run's."""
    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def fp8_eligible(module: nn.Module, name: str, head: bool = False) -> bool:
    """A plain linear layer, not an output head (unless ``head``), with both dimensions multiples of 16."""
    if type(module) is not nn.Linear:
        return False
    if not head and is_head(name):
        return False
    return module.in_features % FP8_DIM_MULTIPLE == 0 and module.out_features % FP8_DIM_MULTIPLE == 0


def is_head(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in HEAD_NAMES


def is_float8(module: nn.Module) -> bool:
    """torchao's ``Float8Linear``, told by name: torchao is imported only where fp8 is applied."""
    return type(module).__name__ == "Float8Linear"


def apply_fp8(model: nn.Module, recipe: str, fsdp_all_gather: bool, head: bool = False) -> int:
    """Swap the eligible ``nn.Linear`` layers of ``model`` for torchao's ``Float8Linear`` in place; returns how many.

    ``fsdp_all_gather``: FSDP2 all-gathers the weights in fp8 (tensorwise recipe only: a rowwise scale is per row of
    the full weight, which a shard cannot compute alone). ``head``: the output head too (``precision.fp8_head``).
    """
    with quiet_torchao_import():
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig.from_recipe_name(recipe)
    if fsdp_all_gather and recipe == "tensorwise":
        config = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
    before = sum(1 for m in model.modules() if type(m) is nn.Linear)
    convert_to_float8_training(model, module_filter_fn=lambda m, name: fp8_eligible(m, name, head), config=config)
    after = sum(1 for m in model.modules() if type(m) is nn.Linear)
    return before - after
