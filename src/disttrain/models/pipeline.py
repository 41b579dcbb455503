"""Pipeline stages of the reference transformer: which layers a stage holds and which stages a rank runs.

Stage ``s`` of ``S`` holds layers ``[s L/S, (s+1) L/S)``; stage 0 also holds the embeddings, stage ``S-1`` the
final norm and the LM head. Blocks live in a ModuleDict keyed by their global layer id, so parameter names
(``blocks.7.attn.wq.weight``) are the same in every layout and the deterministic init gives every stage
exactly the weights of the whole model.
"""

from __future__ import annotations

import torch
from torch import nn

from disttrain.config.schema import ModelConfig
from disttrain.models.transformer import Transformer


def stage_layers(n_layers: int, num_stages: int, stage: int) -> range:
    """The global layer ids of ``stage``; ``n_layers`` must divide by ``num_stages`` (checked at compose time)."""
    if n_layers % num_stages:
        raise ValueError(f"{n_layers} layers do not split into {num_stages} equal stages")
    per = n_layers // num_stages
    return range(stage * per, (stage + 1) * per)


def stages_of_rank(pp_rank: int, pp: int, virtual_stages: int, schedule: str) -> list[int]:
    """Stage indices a pipeline rank runs: looped for interleaved 1F1B, V-shaped for the zero-bubble V."""
    if schedule == "zero_bubble":
        # ZBV: rank r runs stage r on the way down and stage 2p-1-r on the way back, so the last stage sits on
        # rank 0 next to the first one and the loss is computed where the next forward starts.
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + chunk * pp for chunk in range(virtual_stages)]


def build_stage_model(cfg: ModelConfig, stage: int, num_stages: int) -> Transformer:
    """Stage ``stage`` of the model on the meta device (materialize with ``to_empty`` + ``init_weights``)."""
    with torch.device("meta"):
        model = Transformer(cfg)
    keep = stage_layers(cfg.n_layers, num_stages, stage)
    model.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in keep})
    if stage != 0:
        model.tok_emb = None
        model.pos_emb = None
    if stage != num_stages - 1:
        model.norm = None
        model.lm_head = None
    return model
