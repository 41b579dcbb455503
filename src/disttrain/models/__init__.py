"""The reference GPT-2/Llama transformer and its analytic parameter and FLOP accounting."""

from disttrain.models.accounting import (
    block_parameters,
    count_embedding_parameters,
    count_parameters,
    flops_per_token,
    hardware_flops_per_token,
    matmul_parameters,
)
from disttrain.models.transformer import (
    MLP,
    Attention,
    Block,
    Transformer,
    apply_activation_checkpointing,
    build_model,
)

__all__ = [
    "MLP",
    "Attention",
    "Block",
    "Transformer",
    "apply_activation_checkpointing",
    "block_parameters",
    "build_model",
    "count_embedding_parameters",
    "count_parameters",
    "flops_per_token",
    "hardware_flops_per_token",
    "matmul_parameters",
]
