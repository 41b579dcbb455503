"""This rank's share of a Megatron-style 3D run: its model chunks, their pipeline stages and the schedule.

Build order (each step only works after the previous one): tensor parallelism on the ``tp`` axis, activation
checkpointing, FSDP2 on the data-parallel axes (``reshard_after_forward=False`` under pipelining, or every
micro-batch would all-gather the weights again), materialization with the deterministic init, then one
``PipelineStage`` per chunk on the ``pp`` axis. DDP-style ``replicate()`` is never combined with TP: it
trains silently wrong; replicated data parallelism is FSDP2 with a shard group of one instead.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from disttrain.config.degrees import MegatronDegrees
from disttrain.config.hf import hf_shape, load_hf_config
from disttrain.config.schema import HFModelConfig, ModelConfig
from disttrain.config.strategy_schema import MegatronConfig
from disttrain.models.hf import build_hf_model
from disttrain.models.hf_pipeline import build_hf_stage
from disttrain.models.hf_tensor_parallel import apply_hf_tensor_parallel, hf_tp_plan
from disttrain.models.moe import moe_layers
from disttrain.models.pipeline import build_stage_model, stages_of_rank
from disttrain.models.tensor_parallel import apply_tensor_parallel
from disttrain.models.transformer import Attention, Transformer, apply_activation_checkpointing
from disttrain.strategies.megatron.grads import (
    TiedEmbeddingSync,
    clip_grads_,
    global_grad_norm,
    local_tensor,
    stage_group,
    tied_embedding_group,
)

MESH_AXES = ("pp", "dp_replicate", "dp_shard", "tp")


@dataclass
class StepTiming:
    """Where one ``forward_backward`` spent its wall time on this rank (host clock; CUDA work is asynchronous,
    so on GPUs these are launch times unless the caller synchronizes)."""

    forward_s: float = 0.0
    backward_s: float = 0.0
    wall_s: float = 0.0
    pipelined: bool = False  # under a pipeline schedule: the rest of the wall time is waiting for other stages


class _Stopwatch:
    """Accumulates the time spent inside bracketed calls (stage forwards and backwards)."""

    def __init__(self) -> None:
        self.total = 0.0
        self._started: float | None = None

    def start(self, *_: object) -> None:
        self._started = time.perf_counter()

    def stop(self, *_: object) -> None:
        if self._started is not None:
            self.total += time.perf_counter() - self._started
            self._started = None

    def wrap(self, fn: Callable) -> Callable:
        def timed(*args: object, **kwargs: object) -> object:
            self.start()
            try:
                return fn(*args, **kwargs)
            finally:
                self.stop()

        return timed


@dataclass(frozen=True)
class EngineSettings:
    model: ModelConfig | HFModelConfig
    strategy: MegatronConfig
    degrees: MegatronDegrees
    param_dtype: torch.dtype | None  # bf16 for bf16-mixed (FSDP2 casts), None keeps the parameters' dtype
    seed: int
    rounds: int = 1  # pipeline rounds per optimizer step (accumulation beyond the micro-batches)


def build_mesh(degrees: MegatronDegrees, device_type: str) -> DeviceMesh:
    from torch.distributed.device_mesh import init_device_mesh

    shape = (degrees.pp, degrees.dp_replicate, degrees.dp_shard, degrees.tp)
    return init_device_mesh(device_type, shape, mesh_dim_names=MESH_AXES)


def _schedule_class(name: str) -> type:
    from torch.distributed.pipelining import (
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
        ScheduleZBVZeroBubble,
    )

    return {
        "gpipe": ScheduleGPipe,
        "1f1b": Schedule1F1B,
        "interleaved_1f1b": ScheduleInterleaved1F1B,
        "zero_bubble": ScheduleZBVZeroBubble,
    }[name]


_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
_HEADER = 8  # dtype code, number of dims, up to six dims


def _plain(loss: torch.Tensor) -> torch.Tensor:
    """A loss as a plain fp32 tensor (vocab-parallel cross-entropy returns a replicated DTensor)."""
    from torch.distributed.tensor import DTensor

    return (loss.full_tensor() if isinstance(loss, DTensor) else loss).float()


class MegatronEngine:
    """Runs forward/backward of one optimizer step over this rank's chunks; the optimizer stays outside."""

    def __init__(self, settings: EngineSettings, mesh: DeviceMesh, device: torch.device) -> None:
        self.settings = settings
        self.mesh = mesh
        self.device = device
        s, d = settings.strategy, settings.degrees
        self._forward_clock, self._backward_clock = _Stopwatch(), _Stopwatch()
        self.last_timing = StepTiming()
        self.microbatches = s.num_microbatches
        self.rounds = settings.rounds
        self.pp_rank = mesh.get_local_rank("pp")
        self.pp_group = mesh.get_group("pp") if d.pp > 1 else None
        self.hf = isinstance(settings.model, HFModelConfig)
        self.loss_parallel = s.loss_parallel and d.tp > 1
        num_stages = d.pp * s.virtual_stages
        self.stage_ids = stages_of_rank(self.pp_rank, d.pp, s.virtual_stages, s.schedule) if d.pp > 1 else [0]
        # Pipeline rank of every stage (forward-only evaluation passes activations along them in stage order).
        self.stage_owner = {st: r for r in range(d.pp) for st in stages_of_rank(r, d.pp, s.virtual_stages, s.schedule)}
        self.chunks: list[Transformer] = [self._build_chunk(stage, max(num_stages, 1)) for stage in self.stage_ids]
        self.moe_layers = [layer for chunk in self.chunks for layer in moe_layers(chunk)]
        if self.moe_layers:
            self._wire_experts()
        self.has_first = 0 in self.stage_ids
        self.has_last = num_stages - 1 in self.stage_ids or d.pp == 1
        self.schedule = self._build_schedule(num_stages) if d.pp > 1 else None
        self.tied = self._tied_sync() if d.pp > 1 and self._tied_embeddings() else None

    # ---- construction -------------------------------------------------------------------------------------
    def _dp_mesh(self) -> DeviceMesh:
        d = self.settings.degrees
        return self.mesh["dp_replicate", "dp_shard"] if d.dp_replicate > 1 else self.mesh["dp_shard"]

    def _build_hf_chunk(self, stage: int, num_stages: int) -> nn.Module:
        """The HF model, or under pipelining its stage ``stage`` (decoder layers cut evenly), with its own TP plan
        on ``tp`` and FSDP2 on the dp axes."""
        s, d, cfg = self.settings.strategy, self.settings.degrees, self.settings.model
        assert isinstance(cfg, HFModelConfig)
        # Built whole with the deterministic init on every rank, so each tp rank slices the same values and each
        # stage keeps exactly its layers' values; checkpointing wraps the layers before the model is cut.
        model = build_hf_model(cfg, self.settings.seed, self.device)
        if s.activation_checkpointing == "full":
            model.apply_activation_checkpointing()
        elif s.activation_checkpointing == "selective":
            model.apply_selective_recompute()
        if d.pp > 1:
            model = build_hf_stage(model, stage, num_stages)
        if d.tp > 1:
            plan = hf_tp_plan(load_hf_config(cfg)) or {}
            if not apply_hf_tensor_parallel(model, self.mesh["tp"], plan, s.sequence_parallel, self.loss_parallel):
                raise RuntimeError(f"the tensor-parallel plan of {cfg.name} matched none of its modules")
        policy = MixedPrecisionPolicy(param_dtype=self.settings.param_dtype, reduce_dtype=torch.float32)
        # Under pipelining every micro-batch runs forward then (later) backward: keep the gathered weights.
        for block in model.blocks:
            fully_shard(block, mesh=self._dp_mesh(), mp_policy=policy, reshard_after_forward=d.pp == 1)
        fully_shard(model, mesh=self._dp_mesh(), mp_policy=policy, reshard_after_forward=False)
        return model

    def _build_chunk(self, stage: int, num_stages: int) -> Transformer:
        s, d, cfg = self.settings.strategy, self.settings.degrees, self.settings.model
        if isinstance(cfg, HFModelConfig):
            return self._build_hf_chunk(stage, num_stages)  # type: ignore[return-value]
        chunk = build_stage_model(cfg, stage, num_stages)
        if d.tp > 1:
            apply_tensor_parallel(chunk, self.mesh["tp"], s.sequence_parallel, self.loss_parallel)
        if s.activation_checkpointing == "full":
            apply_activation_checkpointing(chunk)
        elif s.activation_checkpointing == "selective":
            for module in chunk.modules():
                if isinstance(module, Attention):
                    module.recompute_core = True
        policy = MixedPrecisionPolicy(param_dtype=self.settings.param_dtype, reduce_dtype=torch.float32)
        options = {"mesh": self._dp_mesh(), "mp_policy": policy}
        # Under pipelining every micro-batch runs forward then (later) backward: keep the gathered weights.
        reshard = d.pp == 1
        for block in chunk.block_list():
            fully_shard(block, reshard_after_forward=reshard, **options)
        fully_shard(chunk, reshard_after_forward=False, **options)
        if self.device.type != "meta":  # on meta only the sharding plan exists (large-world planning tests)
            chunk.to_empty(device=self.device)
            chunk.init_weights(self.settings.seed)
        return chunk

    def _build_schedule(self, num_stages: int) -> Any:
        from torch.distributed.pipelining import PipelineStage

        stages = [
            PipelineStage(chunk, stage, num_stages, self.device, group=self.pp_group)
            for chunk, stage in zip(self.chunks, self.stage_ids, strict=True)
        ]
        # The schedule interleaves forwards, backwards and waits for neighbours; time the first two where they run.
        for chunk, stage in zip(self.chunks, stages, strict=True):
            chunk.register_forward_pre_hook(self._forward_clock.start)
            chunk.register_forward_hook(self._forward_clock.stop)
            stage.backward_one_chunk = self._backward_clock.wrap(stage.backward_one_chunk)
            stage.backward_weight_one_chunk = self._backward_clock.wrap(stage.backward_weight_one_chunk)
        cls = _schedule_class(self.settings.strategy.schedule)
        n = self.microbatches
        # The loss is pre-divided by every micro-batch of the step (scale_grads=False), so gradients are the
        # global-batch mean whatever the number of pipeline rounds.
        if len(stages) == 1:
            return cls(stages[0], n_microbatches=n, loss_fn=self._loss_fn, scale_grads=False)
        return cls(stages, n_microbatches=n, loss_fn=self._loss_fn, scale_grads=False)

    def _tied_embeddings(self) -> bool:
        model = self.settings.model
        if isinstance(model, HFModelConfig):
            return hf_shape(model).tie_embeddings
        return model.tie_embeddings

    def _tied_sync(self) -> TiedEmbeddingSync:
        mesh_ranks = self.mesh.mesh  # [pp, dp_replicate, dp_shard, tp] -> global rank
        group = tied_embedding_group(mesh_ranks, dist.get_rank())
        local = []
        for chunk in self.chunks:
            if chunk.tok_emb is not None:
                local.append(chunk.tok_emb.weight)
            if chunk.lm_head is not None:
                local.append(chunk.lm_head.weight)
        # The V schedule holds both copies on pipeline rank 0: the local sum is all it needs.
        both_here = self.has_first and self.has_last
        return TiedEmbeddingSync(local, None if both_here else group)

    # ---- running ------------------------------------------------------------------------------------------
    def parameters(self) -> Iterator[nn.Parameter]:
        for chunk in self.chunks:
            yield from chunk.parameters()

    def _loss_fn(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))
        return loss / (self.microbatches * self.rounds)

    def _wire_experts(self) -> None:
        """MoE layers under pipelining: each attaches its balancing/z-loss gradient to its output, scaled as the
        language-model loss of one micro-batch is (a stage's backward starts from activations, not from the
        objective), and counts the balancing statistics over the ranks holding its stage (every rank: pp=1)."""
        group = stage_group(self.mesh.mesh, dist.get_rank()) if self.pp_group is not None else None
        for layer in self.moe_layers:
            layer.attach_aux_scale = 1.0 / (self.microbatches * self.rounds)
            layer.balance_group = group

    @contextlib.contextmanager
    def _loss_context(self) -> Iterator[None]:
        if self.loss_parallel:
            from torch.distributed.tensor.parallel import loss_parallel

            with loss_parallel():
                yield
        else:
            yield

    def _broadcast_loss(self, local_sum: torch.Tensor) -> torch.Tensor:
        """The step loss lives on the last stage; every pipeline rank returns it (for logging)."""
        if self.pp_group is not None:
            if not self.has_last:
                local_sum = torch.zeros_like(local_sum)
            dist.all_reduce(local_sum, group=self.pp_group)
        return local_sum

    def forward_backward(
        self, inputs: torch.Tensor, targets: torch.Tensor, backward: Callable[[torch.Tensor], None]
    ) -> torch.Tensor:
        """Accumulate the gradients of this rank's step batch; returns its mean loss on every rank.

        ``last_timing`` afterwards says how long this rank computed forward and backward within the call.
        """
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        forward, backward_clock = self._forward_clock, self._backward_clock
        forward.total = backward_clock.total = 0.0
        started = time.perf_counter()
        with self._loss_context():
            if self.schedule is None:
                chunk = self.chunks[0]
                n = self.microbatches * self.rounds
                for i, (x, y) in enumerate(zip(inputs.chunk(n), targets.chunk(n), strict=True)):
                    # Reduce-scatter gradients once per step, not once per micro-batch.
                    chunk.set_requires_gradient_sync(i == n - 1)
                    forward.start()
                    loss = self._loss_fn(chunk(x), y)
                    forward.stop()
                    backward_clock.wrap(backward)(loss)
                    total += _plain(loss.detach())
            else:
                for x, y in zip(inputs.chunk(self.rounds), targets.chunk(self.rounds), strict=True):
                    losses: list[torch.Tensor] = []
                    self._step_schedule(x, y, losses)
                    total += sum((_plain(loss.detach()) for loss in losses), torch.zeros((), device=self.device))
        if self.tied is not None:
            self.tied.sync()
        wall = time.perf_counter() - started
        self.last_timing = StepTiming(forward.total, backward_clock.total, wall, self.schedule is not None)
        return self._broadcast_loss(total)

    def _step_schedule(self, x: torch.Tensor, y: torch.Tensor, losses: list) -> None:
        run = self.schedule.step  # type: ignore[union-attr]
        if self.has_first:
            run(x, target=y if self.has_last else None, losses=losses if self.has_last else None, return_outputs=False)
        elif self.has_last:
            run(target=y, losses=losses, return_outputs=False)
        else:
            run(return_outputs=False)

    @torch.no_grad()
    def evaluate(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean loss of a batch (forward only), on every rank."""
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        with self._loss_context():
            if self.schedule is None:
                n = self.microbatches * self.rounds
                for x, y in zip(inputs.chunk(n), targets.chunk(n), strict=True):
                    total += _plain(self._loss_fn(self.chunks[0](x), y))
            else:
                n = self.microbatches * self.rounds
                for x, y in zip(inputs.chunk(n), targets.chunk(n), strict=True):
                    loss = self._forward_through_stages(x, y)
                    if loss is not None:
                        total += _plain(loss)
        return self._broadcast_loss(total)

    def _forward_through_stages(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor | None:
        """One micro-batch forward through every stage in order, activations passed between pipeline ranks by
        send/recv; the loss on the rank holding the last stage (None elsewhere).

        Evaluation does not go through the training schedule's ``eval``: torch's runtime schedules (the
        zero-bubble V) still run their backward actions there and fail (torch 2.13: "can't steal_bwd_input if this
        stage doesn't have backward"). Forward only, nothing overlaps: one path for every schedule.
        """
        owner = self.stage_owner
        mine = dict(zip(self.stage_ids, self.chunks, strict=True))
        act: torch.Tensor | None = None
        for stage in range(len(owner)):
            if owner[stage] != self.pp_rank:
                continue
            if stage > 0 and owner[stage - 1] != self.pp_rank:
                act = self._receive_activation(owner[stage - 1])
            out = mine[stage](x if stage == 0 else act)
            if stage == len(owner) - 1:
                return self._loss_fn(out, y)
            act = local_tensor(out)
            if owner[stage + 1] != self.pp_rank:
                self._send_activation(act, owner[stage + 1])
        return None

    def _peer(self, pp_rank: int) -> int:
        return dist.get_global_rank(self.pp_group, pp_rank)  # type: ignore[arg-type]

    def _send_activation(self, act: torch.Tensor, pp_rank: int) -> None:
        # Shape and dtype first: stages differ in what they pass (a TP or HF stage's hidden states).
        header = torch.zeros(_HEADER, dtype=torch.int64)
        header[0] = _DTYPES.index(act.dtype)
        header[1] = act.dim()
        header[2 : 2 + act.dim()] = torch.tensor(act.shape)
        dist.send(header.to(act.device), self._peer(pp_rank), group=self.pp_group)
        dist.send(act.contiguous(), self._peer(pp_rank), group=self.pp_group)

    def _receive_activation(self, pp_rank: int) -> torch.Tensor:
        header = torch.zeros(_HEADER, dtype=torch.int64, device=self.device)
        dist.recv(header, self._peer(pp_rank), group=self.pp_group)
        code, ndim, *dims = header.tolist()
        act = torch.empty(dims[:ndim], dtype=_DTYPES[code], device=self.device)
        dist.recv(act, self._peer(pp_rank), group=self.pp_group)
        return act

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip to ``max_norm`` by the norm of the whole model's gradient (as one process would compute it)."""
        params = list(self.parameters())
        counted = params
        if self.tied is not None:
            # The tied weight has two copies with the same (summed) gradient: count it once, at the first stage.
            copies = {id(chunk.lm_head.weight) for chunk in self.chunks if chunk.lm_head is not None}
            counted = [p for p in params if id(p) not in copies]
        norm = global_grad_norm(counted, self.mesh.size() // self.settings.degrees.pp, self.device)
        clip_grads_(params, max_norm, norm)
        return norm
