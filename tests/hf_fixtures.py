"""Everything a ``model=hf`` / ``data=hf`` test needs, built locally: tiny HF configs and model directories, a
tokenizer trained with ``tokenizers`` on a small text, a few hundred lines of jsonl/parquet."""

from __future__ import annotations

import json
from pathlib import Path

TINY_LLAMA = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 176,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 320,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}

WORDS = ["the", "a", "model", "trains", "on", "data", "shards", "ranks", "gather", "reduce", "tokens", "loss", "falls"]


def sentences(n: int, seed: int = 0) -> list[str]:
    import random

    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 14))) + "." for _ in range(n)]


def save_tiny_model(directory: Path, config: dict | None = None, seed: int = 3) -> Path:
    """A tiny causal LM written with save_pretrained (config.json + model.safetensors)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(config or TINY_LLAMA)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(fields.pop("model_type"), **fields))
    model.save_pretrained(str(directory))
    return directory


def train_tokenizer(path: Path, texts: list[str], vocab_size: int = 300) -> Path:
    """A byte-level BPE tokenizer trained on ``texts`` with ``tokenizers``, saved as one JSON file."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer.save(str(path))
    return path


def write_jsonl(path: Path, texts: list[str], column: str = "text") -> Path:
    path.write_text("".join(json.dumps({column: t, "id": i}) + "\n" for i, t in enumerate(texts)))
    return path


# Tiny MoE families as transformers 5 builds them (fused expert weights): Mixtral (renormalised top-2), Qwen2-MoE
# (shared expert behind a sigmoid gate, top-k weights not renormalised) and OLMoE (QK-norm, renormalised top-k).
_TINY_MOE_BASE = {
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 128,
    "max_position_embeddings": 128,
    "tie_word_embeddings": False,
}
TINY_MIXTRAL = {
    **_TINY_MOE_BASE, "model_type": "mixtral", "intermediate_size": 48, "num_local_experts": 4,
    "num_experts_per_tok": 2, "router_aux_loss_coef": 0.02,
}  # fmt: skip
TINY_QWEN2_MOE = {
    **_TINY_MOE_BASE, "model_type": "qwen2_moe", "intermediate_size": 64, "moe_intermediate_size": 24,
    "shared_expert_intermediate_size": 48, "num_experts": 8, "num_experts_per_tok": 3, "norm_topk_prob": False,
    "router_aux_loss_coef": 0.001,
}  # fmt: skip
TINY_OLMOE = {
    **_TINY_MOE_BASE, "model_type": "olmoe", "intermediate_size": 24, "num_experts": 8, "num_experts_per_tok": 2,
    "norm_topk_prob": True, "router_aux_loss_coef": 0.01,
}  # fmt: skip
TINY_MOE_CONFIGS = {"mixtral": TINY_MIXTRAL, "qwen2_moe": TINY_QWEN2_MOE, "olmoe": TINY_OLMOE}
