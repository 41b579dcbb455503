"""Pipeline stages of a Llama-family Hugging Face model, cut between decoder layers.

A stage is the HF model itself with what it does not run removed: stage ``s`` of ``S`` keeps decoder layers
``[s L/S, (s+1) L/S)``; the first also keeps the token embedding, the last the final norm and the LM head; the
others get identities in their place. The model's own ``forward`` then runs the stage (token ids in on the first
stage, hidden states in as ``inputs_embeds`` elsewhere; logits out of the last, hidden states out of the others),
so causal masking, RoPE and attention are exactly transformers' own. The kept layers stay under their global
index (``hf.model.layers.3.*``), so parameter names, the deterministic init, checkpoints and the HF export are
those of the whole model in every layout.

Supported: models whose base model holds ``embed_tokens``, ``layers`` (a ModuleList), ``norm`` and whose causal
LM holds ``lm_head`` -- Llama, Mistral, Qwen2/3, ... (``pipeline_structure_problem`` says why another is not).
"""

from __future__ import annotations

from torch import nn

from disttrain.models.hf import HFCausalLM
from disttrain.models.hf_tensor_parallel import gather_sequence
from disttrain.models.pipeline import stage_layers

STAGE_PARTS = ("embed_tokens", "layers", "norm")


class StageLayers(nn.ModuleList):
    """Some of a model's decoder layers under their global indices (``layers.2``, ``layers.3`` on stage 1 of 2).

    Iterating and slicing (what the HF forward does: ``self.layers[: num_hidden_layers]``) give the kept layers in
    order; indexing by position is not offered, since positions are not layer ids here.
    """

    def __init__(self, layers: dict[int, nn.Module]) -> None:
        super().__init__()
        for index, layer in layers.items():
            self.add_module(str(index), layer)

    def __getitem__(self, idx: int | slice) -> nn.Module | nn.ModuleList:
        if isinstance(idx, slice):
            return nn.ModuleList(list(self._modules.values())[idx])
        raise TypeError("a pipeline stage's layers are addressed by iteration or slices, not by position")


def pipeline_structure_problem(wrapper: HFCausalLM) -> str | None:
    """Why this HF model cannot be cut into stages here, or None when it can."""
    hf = wrapper.hf
    base = getattr(hf, getattr(hf, "base_model_prefix", ""), None)
    if base is None:
        return f"{type(hf).__name__} has no base model attribute"
    missing = [part for part in STAGE_PARTS if not isinstance(getattr(base, part, None), nn.Module)]
    if not isinstance(getattr(hf, "lm_head", None), nn.Module):
        missing.append("lm_head")
    if missing:
        return f"{type(hf).__name__} has no {', '.join(missing)} (a Llama-style decoder is needed)"
    if not isinstance(base.layers, nn.ModuleList):
        return f"{type(base).__name__}.layers is not a ModuleList"
    return None


class HFStage(HFCausalLM):
    """One pipeline stage of an HF causal LM; ``forward`` maps token ids or hidden states to hidden states or
    logits. ``tok_emb`` / ``lm_head`` are the stage's copies of a tied embedding (the engine keeps them equal)."""

    def __init__(self, wrapper: HFCausalLM, stage: int, num_stages: int) -> None:
        super().__init__(wrapper.hf)
        problem = pipeline_structure_problem(wrapper)
        if problem is not None:
            raise ValueError(f"cannot cut {type(wrapper.hf).__name__} into pipeline stages: {problem}")
        hf, base = self.hf, getattr(self.hf, self.hf.base_model_prefix)
        self.first, self.last = stage == 0, stage == num_stages - 1
        keep = stage_layers(len(base.layers), num_stages, stage)
        base.layers = StageLayers({i: base.layers[i] for i in keep})
        # Identity stand-ins keep the HF forward's own code path; a dropped part is never called on its stage.
        if not self.first:
            base.embed_tokens = nn.Identity()
        if not self.last:
            base.norm = nn.Identity()
            hf.lm_head = nn.Identity()

    # Properties, not attributes: a second registration would add the same weights under a second name.
    @property
    def tok_emb(self) -> nn.Module | None:
        """The token embedding on the first stage (a tied LM head's weight is then its Parameter here)."""
        return getattr(self.hf, self.hf.base_model_prefix).embed_tokens if self.first else None

    @property
    def lm_head(self) -> nn.Module | None:
        """The LM head on the last stage (tied: its own copy of the embedding there, kept equal by the engine)."""
        return self.hf.lm_head if self.last else None

    def _block_slots(self) -> list[tuple[nn.ModuleList, int, nn.Module]]:
        base = getattr(self.hf, self.hf.base_model_prefix)
        return [(base.layers, index, layer) for index, layer in enumerate(base.layers)]

    def apply_activation_checkpointing(self) -> None:
        raise RuntimeError("checkpoint the whole model's layers before cutting it into stages")

    def forward(self, inputs):  # type: ignore[override]
        if self.first:
            return self.hf(input_ids=inputs, use_cache=False).logits
        mesh = getattr(self, "sequence_mesh", None)
        if mesh is not None:
            # Sequence parallel: the previous stage sent this tp rank's slice of the sequence. The model's forward
            # derives positions, RoPE and the causal mask from the length of what it gets: give it all of it.
            inputs = gather_sequence(inputs, mesh)
        return self.hf(inputs_embeds=inputs, use_cache=False).logits


def build_hf_stage(wrapper: HFCausalLM, stage: int, num_stages: int) -> HFStage:
    """Cut ``wrapper`` (built whole, with its deterministic init or loaded weights) down to ``stage``."""
    return HFStage(wrapper, stage, num_stages)
