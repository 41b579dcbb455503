"""DeepSpeed ZeRO partitions <-> the universal checkpoint layout (single-process names, full tensors).

ZeRO keeps the fp32 master weights and Adam's moments as flat partitions of each parameter group, one slice per
rank; the model's own parameters are full (stages 1, 2) or partitioned too (stage 3). DeepSpeed's tensor-fragment
API (``safe_get_full_fp32_param``, ``safe_get_full_optimizer_state`` and their setters) maps one parameter to its
slices on every rank, so each parameter is gathered into a full tensor under its single-process name on save, and
a full tensor read from any checkpoint is scattered back into this run's partitions on load (the setters keep only
this rank's slice). Gathering is collective and parameter by parameter: every rank walks the parameters in the same
order. The full state of the model and its optimizer passes through each rank's host memory while it is written
(DCP writes each tensor once); that bounds the model size this path serves to what one host holds.

The optimizer's state and hyper-parameters use torch's flattened names (``state.<name>.exp_avg``,
``param_groups.<name>.lr``), exactly what ``get_optimizer_state_dict`` gives the other strategies for the same
torch optimizer, so a DeepSpeed checkpoint resumes under DDP/FSDP/Megatron and back.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from disttrain.checkpoint.universal import PARAM_GROUPS, STATE
from disttrain.models.transformer import canonical_name

STEP = "step"


def persistent_buffers(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The buffers ``state_dict`` would hold (non-persistent ones, like a rope cache, are derived, not saved)."""
    for prefix, sub in module.named_modules():
        for name, buffer in sub.named_buffers(recurse=False):
            if buffer is not None and name not in sub._non_persistent_buffers_set:
                yield (f"{prefix}.{name}" if prefix else name), buffer


def param_names(module: nn.Module) -> dict[int, list[str]]:
    """Every single-process name of each parameter, by ``id``: a tied weight has two (``tok_emb``, ``lm_head``)."""
    names: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(canonical_name(name))
    return names


def zero_groups(zero: Any) -> list[tuple[int, list[nn.Parameter], torch.Tensor]]:
    """(index into the base optimizer's param_groups, the model parameters, the flat fp32 partition) per ZeRO group."""
    if hasattr(zero, "fp16_groups") and hasattr(zero, "fp32_partitioned_groups_flat"):  # stage 3: sub-groups
        return [
            (zero.sub_group_to_group_id[i], list(group), zero.fp32_partitioned_groups_flat[i])
            for i, group in enumerate(zero.fp16_groups)
        ]
    if hasattr(zero, "bit16_groups") and hasattr(zero, "single_partition_of_fp32_groups"):  # stages 1 and 2
        return [(i, list(group), zero.single_partition_of_fp32_groups[i]) for i, group in enumerate(zero.bit16_groups)]
    raise RuntimeError(
        f"the universal checkpoint cannot read DeepSpeed's {type(zero).__name__} partitions (ZeRO stage 1-3 optimizers "
        "only)"
    )


def moment_keys(index: dict[str, Any], prefix: str, template_names: list[str]) -> tuple[str, ...]:
    """The optimizer state entries (``exp_avg``, ``exp_avg_sq``, ...) the checkpoint holds for a parameter."""
    for name in template_names:
        head = f"{prefix}.{STATE}.{name}."
        found = tuple(sorted({k[len(head) :] for k in index if k.startswith(head)} - {STEP}))
        if found:
            return found
    return ()


def _full_shape(param: nn.Parameter) -> torch.Size:
    return param.ds_shape if hasattr(param, "ds_shape") else param.shape


def partition_numels(module: nn.Module, zero: Any) -> dict[str, list[int]]:
    """Elements this rank holds per optimizer group: fp32 master partition, and (stage 3) model parameter slices."""
    groups: dict[int, list[int]] = {}
    params: dict[int, int] = {}
    for group_id, members, flat in zero_groups(zero):
        groups.setdefault(group_id, []).append(flat.numel())
        params[group_id] = params.get(group_id, 0) + sum(
            p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel() for p in members
        )
    ordered = sorted(groups)
    return {"fp32_partition": [sum(groups[g]) for g in ordered], "params": [params[g] for g in ordered]}


def full_model_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """The fp32 master weights under every single-process name, plus persistent buffers (a collective)."""
    from deepspeed.utils import safe_get_full_fp32_param

    names = param_names(module)
    state: dict[str, torch.Tensor] = {}
    for param in module.parameters():
        full = safe_get_full_fp32_param(param)
        value = (full if full is not None else param.detach()).reshape(_full_shape(param)).float().cpu()
        for name in names[id(param)]:
            state[name] = value
    for name, buffer in persistent_buffers(module):
        state[canonical_name(name)] = buffer.detach().cpu()
    return state


def full_optimizer_state(module: nn.Module, zero: Any) -> dict[str, Any]:
    """The ZeRO optimizer's state gathered under torch's flattened names (a collective)."""
    from deepspeed.utils import safe_get_full_optimizer_state

    names = param_names(module)
    base = zero.optimizer
    relink_fragments(zero)
    out: dict[str, Any] = {}
    for group_id, params, flat in zero_groups(zero):
        held = base.state.get(flat, {})
        keys = sorted(k for k, v in held.items() if k != STEP and torch.is_tensor(v) and v.numel() == flat.numel())
        hyper = {k: v for k, v in base.param_groups[group_id].items() if k != "params"}
        step = held.get(STEP)
        for param in params:
            name = names[id(param)][0]  # the optimizer state sits under the first name, as torch keys it
            for key in keys:
                value = safe_get_full_optimizer_state(param, key)
                out[f"{STATE}.{name}.{key}"] = value.reshape(_full_shape(param)).float().cpu()
            if step is not None:
                out[f"{STATE}.{name}.{STEP}"] = step.detach().clone().cpu() if torch.is_tensor(step) else step
            for key, value in hyper.items():
                out[f"{PARAM_GROUPS}.{name}.{key}"] = value
    return out


def model_template(module: nn.Module) -> dict[str, torch.Tensor]:
    """Empty full-size fp32 tensors under every name ``full_model_state`` writes (what a load reads into)."""
    names = param_names(module)
    state = {
        name: torch.empty(_full_shape(param), dtype=torch.float32)
        for param in module.parameters()
        for name in names[id(param)]
    }
    for name, buffer in persistent_buffers(module):
        state[canonical_name(name)] = torch.empty_like(buffer, device="cpu")
    return state


def saves_step(index: dict[str, Any], prefix: str, template_names: list[str]) -> bool:
    """Whether the checkpoint's optimizer counts steps per parameter (Adam does; SGD with momentum does not)."""
    return any(f"{prefix}.{STATE}.{name}.{STEP}" in index for name in template_names)


def optimizer_template(
    module: nn.Module, zero: Any, moment_keys: tuple[str, ...], with_step: bool = True
) -> dict[str, Any]:
    """What a load reads into: the moments, the step (where the optimizer keeps one) and this optimizer's
    hyper-parameters per parameter."""
    names = param_names(module)
    out: dict[str, Any] = {}
    for group_id, params, _ in zero_groups(zero):
        hyper = {k: v for k, v in zero.optimizer.param_groups[group_id].items() if k != "params"}
        for param in params:
            name = names[id(param)][0]
            for key in moment_keys:
                out[f"{STATE}.{name}.{key}"] = torch.empty(_full_shape(param), dtype=torch.float32)
            if with_step:
                out[f"{STATE}.{name}.{STEP}"] = torch.zeros((), dtype=torch.float32)
            for key, value in hyper.items():
                out[f"{PARAM_GROUPS}.{name}.{key}"] = value
    return out


def load_model_state(module: nn.Module, zero: Any, state: dict[str, torch.Tensor]) -> None:
    """Full fp32 weights into this rank's partitions: the fp32 master and the model's own (possibly 16-bit) copy."""
    from deepspeed.utils import safe_set_full_fp32_param

    names = param_names(module)
    stage3 = hasattr(zero, "fp32_partitioned_groups_flat")
    if stage3:
        zero.checkpoint_event_prologue()  # partition every parameter: no stale gathered copy survives the load
    for param in module.parameters():
        value = state[names[id(param)][0]]
        if param.requires_grad:
            safe_set_full_fp32_param(param, value.to(torch.float32))
        if not stage3:
            with torch.no_grad():
                param.copy_(value.to(param.dtype))
    for name, buffer in persistent_buffers(module):
        with torch.no_grad():
            buffer.copy_(state[canonical_name(name)])
    if stage3:
        _stage3_refresh_partitions(zero)
        zero.checkpoint_event_epilogue()


def _stage3_refresh_partitions(zero: Any) -> None:
    """ZeRO-3: the model's partitions from the fp32 master partitions (as DeepSpeed's universal loader does)."""
    for i, fp32 in enumerate(zero.fp32_partitioned_groups_flat):
        if fp32.numel() > 0:
            zero.fp16_partitioned_groups_flat[i].data.copy_(fp32.data)
    for i, flat in enumerate(zero.fp16_partitioned_groups_flat):
        for partitioned, part in zip(
            zero.fp16_partitioned_groups[i], zero.unflatten(flat, zero.fp16_partitioned_groups[i]), strict=True
        ):
            partitioned.data = part.data


def relink_fragments(zero: Any) -> None:
    """Stages 1/2: point each parameter's optimizer-state fragments at the base optimizer's current state tensors.

    DeepSpeed links them once, and may do so before the first step created the state (then they stay empty), so
    they are linked afresh before a save reads them and after a load replaced them."""
    if hasattr(zero, "_hp_optimizer_states_linked"):
        zero._hp_optimizer_states_linked = False
        zero._lazy_init_hp_params_optimizer_state()


def load_optimizer_state(module: nn.Module, zero: Any, state: dict[str, Any], moment_keys: tuple[str, ...]) -> None:
    """Full moments into this rank's flat partitions, the step and hyper-parameters into the base optimizer."""
    from deepspeed.utils import safe_set_full_optimizer_state

    names = param_names(module)
    base = zero.optimizer
    for group_id, params, flat in zero_groups(zero):
        first = names[id(params[0])][0] if params else None
        step = state.get(f"{STATE}.{first}.{STEP}") if first else None
        held = {key: torch.zeros_like(flat) for key in moment_keys}
        if step is not None:
            held[STEP] = step.detach().clone() if torch.is_tensor(step) else torch.tensor(float(step))
        base.state[flat] = held
        if first is not None:
            prefix = f"{PARAM_GROUPS}.{first}."
            base.param_groups[group_id].update({k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)})
    relink_fragments(zero)
    for _, params, _ in zero_groups(zero):
        for param in params:
            if not param.requires_grad:
                continue
            name = names[id(param)][0]
            for key in moment_keys:
                safe_set_full_optimizer_state(param, state[f"{STATE}.{name}.{key}"].to(torch.float32), key)
