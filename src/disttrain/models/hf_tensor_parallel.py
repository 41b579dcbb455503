"""Megatron-style tensor parallelism for Hugging Face models, from the model's own ``base_model_tp_plan``.

Llama-family configs (Llama, Mistral, Qwen2, ...) state which projections are column-wise (q/k/v, gate/up) and
which row-wise (o, down): each rank keeps whole heads and one slice of the MLP, one all-reduce per sub-layer in
forward and one in backward. Embeddings, norms and the LM head stay replicated over ``tp`` (their gradients are
identical on every tp rank), which is why sequence parallelism and vocab-parallel loss are not offered here.
Only the plain ``colwise`` / ``rowwise`` styles are applied; a plan with any other style is refused before launch.
"""

from __future__ import annotations

import fnmatch

from torch import nn

SUPPORTED_STYLES = ("colwise", "rowwise")


def hf_tp_plan(config: object) -> dict[str, str] | None:
    """The architecture's own tensor-parallel plan (module pattern under the base model -> style), if any."""
    plan = getattr(config, "base_model_tp_plan", None)
    return dict(plan) if plan else None


def unsupported_styles(plan: dict[str, str]) -> list[str]:
    return sorted({style for style in plan.values() if style not in SUPPORTED_STYLES})


def apply_hf_tensor_parallel(wrapper: nn.Module, tp_mesh: object, plan: dict[str, str]) -> int:
    """Shard the matching projections of ``wrapper.hf``'s base model over ``tp_mesh`` in place; returns how many."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    hf = wrapper.hf  # type: ignore[attr-defined]
    base = getattr(hf, hf.base_model_prefix)
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    # Concrete module paths: checkpoint wrappers add a segment that the plan's patterns do not know about.
    names = {name.replace("._checkpoint_wrapped_module", ""): name for name, _ in base.named_modules()}
    layout = {}
    for pattern, style in plan.items():
        for clean, real in names.items():
            if fnmatch.fnmatchcase(clean, pattern) and "." in clean:
                layout[real] = styles[style]()
    if layout:
        parallelize_module(base, tp_mesh, layout)
    return len(layout)
