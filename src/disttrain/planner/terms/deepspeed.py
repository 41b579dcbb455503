"""strategy=deepspeed's terms: ZeRO-1/2/3 (Rajbhandari et al. 2020) with optimizer and parameter offload to the host
or NVMe (ZeRO-Offload, ZeRO-Infinity).

16-bit parameters and gradients plus K = 12 bytes of fp32 master weights, momentum and variance, partitioned per
stage; the stage-3 working set is at least the largest layer (DeepSpeed's own ``estimate_zero3_model_states_mem_needs``
uses 4 bytes x its parameters).
"""

from __future__ import annotations

import math
from typing import Any

from disttrain.config.hardware import HardwareProfile
from disttrain.planner.breakdown import MemoryBreakdown
from disttrain.planner.links import ZERO, CommPlan, Group, LinkBytes, Sync, collective_bytes
from disttrain.planner.shapes import ModelShape
from disttrain.planner.spec import Layout, StrategyTerms, Workload, recompute_suffix

# Lightning's DeepSpeedStrategy defaults (elements): reduce_bucket_size and allgather_bucket_size are 2e8 each;
# overlap_comm (on by default) double-buffers the reduce bucket.
DEEPSPEED_REDUCE_BUCKET = 200_000_000


DEEPSPEED_ALLGATHER_BUCKET = 200_000_000


# ZeRO-Infinity's swap buffers as DeepSpeed 0.19 sizes them with our config: the optimizer swapper pins
# offload_optimizer.buffer_count fp32 buffers of the largest sub-group (zero_optimization.sub_group_size, which
# strategies/deepspeed.py sets to NVME_SUB_GROUP under optimizer offload to nvme: at DeepSpeed's 1e9 the buffers
# would take more host memory than the states they swap); the parameter swapper offload_param.buffer_count buffers
# of offload_param.buffer_size elements (DeepSpeed's defaults).
NVME_SUB_GROUP = 100_000_000


NVME_OPTIMIZER_BUFFERS = 4


NVME_PARAM_BUFFERS = 5


NVME_PARAM_BUFFER_ELEMENTS = 100_000_000


# ZeRO stages whose engine the ZeRO probe times (stage 3 partitions parameters: another engine, other hooks).
ZERO_HOST_STAGES = (1, 2)


class DeepSpeedTerms(StrategyTerms):
    name = "deepspeed"

    def options(self, layout: Layout) -> dict[str, Any]:
        return {
            "stage": layout.zero_stage,
            "offload_optimizer": _offload_value(layout.offload_optimizer, layout.nvme_optimizer),
            "offload_params": _offload_value(layout.offload_params, layout.nvme_params),
            "activation_checkpointing": layout.recompute == "full",
        }

    def label(self, layout: Layout) -> str:
        offloads = (
            ("opt", layout.offload_optimizer, layout.nvme_optimizer),
            ("param", layout.offload_params, layout.nvme_params),
        )
        where = [name + ("->nvme" if nvme else "") for name, on, nvme in offloads if on]
        offload = f" +offload({','.join(where)})" if where else ""
        return f"ZeRO-{layout.zero_stage}{offload}{recompute_suffix(layout)}"

    def model_states(self, shape: ModelShape, layout: Layout, workload: Workload, stage: int) -> MemoryBreakdown:
        """ZeRO-1/2/3 model states, as DeepSpeed allocates them.

        Against DeepSpeed's own ``estimate_zero2_model_states_mem_needs`` / ``estimate_zero3_..._needs`` (what the
        ``*_all_cold`` functions print; ``tests/unit/test_planner_deepspeed_estimators.py`` compares byte for byte):
        their GPU figure equals ``params + grads + optimizer_states`` plus the fp32 gradient partition (and, for
        stage 3, 4 bytes x the largest layer) here, for stage 2 with and without optimizer offload and stage 3 with
        optimizer (and parameter) offload. Where we differ, and why:

        - Stage 3 without offload: DeepSpeed's estimator counts 18 bytes per parameter partition; stage 3 also keeps
          the 16-bit gradient partition it reduces into (``grad_partitions_flat_buffer``, on the GPU unless the
          optimizer is offloaded) while the step upcasts it to fp32, so 20 here.
        - Partitions are ``ceil(P / N)`` (DeepSpeed pads flat buffers to equal partitions); the estimator floors
          ``18 P / N``. They agree when N divides P.
        - Stage 3 keeps the parameters under ``layout.persistence_threshold`` whole on every rank (beside their
          partition), and in fp32 still copies its parameter partition into a separate fp32 master partition
          (DeepSpeed 0.19's alias for same-dtype groups compares a device with a device name, never equal): K = 12.
          The estimator counts neither. Measured on a 2-rank CPU run of gpt-nano: 20.887 MB counted, 20.887 MB here.
        - The estimator has no reduce/all-gather buckets; Lightning's defaults allocate them (``buffers``).
        - Host memory: the estimator's CPU column is per node, times a 1.5 safety factor, and for stages 1/2 (no
          ``zero.Init``) the whole fp32 model loaded by every process at start-up; ``host`` here is the steady
          state one rank keeps there (fp32 master, momentum, variance, fp32 gradients, offloaded parameters), which
          times the node's GPUs equals the estimator's zero-init figure before its 1.5 factor.
        """
        precision = workload.precision
        n, dp, zero_stage = shape.num_parameters, layout.dp, layout.zero_stage
        moments = round(shape.optimizer_states * 4)  # the optimizer's fp32 states (AdamW: momentum and variance)
        if precision == "fp32":
            p16, g16, k, fp32_grads = 4, 4, moments, 0  # no master copy: K = 8 under AdamW
        else:
            p16, g16, k, fp32_grads = 2, 2, 4 + moments, 4  # K = 12 under AdamW: fp32 master, momentum, variance
        if zero_stage == 3 and precision == "fp32":
            k = 4 + moments  # the fp32 master partition is a copy of the parameter partition, then the states
        shard = math.ceil(n / dp)
        persistent = shape.small_parameters(layout.persistence_threshold) if zero_stage == 3 else 0
        params = p16 * (shard + persistent if zero_stage == 3 else n)
        grads = g16 * (n if zero_stage == 1 else shard)
        optimizer = k * shard
        # DeepSpeed upcasts this rank's gradient partition to fp32 for the optimizer step.
        buffers = fp32_grads * shard + 2 * g16 * min(DEEPSPEED_REDUCE_BUCKET, n)
        if zero_stage == 3:
            buffers += 4 * shape.largest_module_parameters + p16 * min(DEEPSPEED_ALLGATHER_BUCKET, n)
        else:
            buffers += p16 * min(DEEPSPEED_ALLGATHER_BUCKET, n)
        host = nvme = 0
        if layout.nvme_optimizer:
            # ZeRO-Infinity: the states (K bytes per parameter of the partition) live on NVMe and are swapped through
            # DeepSpeed's pinned host buffers (offload_optimizer.buffer_count of them, each the largest sub-group in
            # fp32); the fp32 gradient partition stays on the host as under ZeRO-Offload.
            nvme += k * shard
            host += NVME_OPTIMIZER_BUFFERS * 4 * min(shard, NVME_SUB_GROUP) - k * shard
        if layout.nvme_params:
            # The 16-bit partition on NVMe, read through offload_param.buffer_count pinned buffers of buffer_size.
            nvme += p16 * shard
            host += NVME_PARAM_BUFFERS * p16 * nvme_param_buffer_elements(shape, dp) - p16 * shard
        if layout.offload_optimizer:
            # ZeRO-Offload: states, the step and the fp32 gradient partition move to the host. Stage 3 allocates its
            # gradient partition buffer on the CPU; stage 2 copies each reduced bucket into the CPU fp32 gradients.
            # Stage 1 does not partition gradients: the 16-bit gradients accumulate on the GPU until the step.
            host += optimizer + fp32_grads * shard
            buffers -= fp32_grads * shard
            optimizer = 0
            if zero_stage > 1:
                host += g16 * shard if fp32_grads == 0 else 0  # fp32 training: the partition itself is the fp32 one
                grads = 0
        if layout.offload_params:  # ZeRO-Infinity: the 16-bit parameter partition lives on the host too
            host += p16 * shard
            params = p16 * persistent  # the persistent parameters stay whole on the device
        return MemoryBreakdown(params, grads, optimizer, 0, buffers, host=host, nvme=nvme)

    def comm(self, shape: ModelShape, layout: Layout, workload: Workload, groups: dict[str, Group]) -> CommPlan:
        n, dp, stage = shape.num_parameters, layout.dp, layout.zero_stage
        p16 = g16 = 4 if workload.precision == "fp32" else 2
        group = groups["dp"]
        # ZeRO-1/2 reduce each gradient bucket with one all-reduce and keep their own partition of the result
        # (DeepSpeed's zero_optimization.use_multi_rank_bucket_allreduce, on by default in 0.19: a ZeRO-2 profile here
        # showed gloo all-reduces and no reduce-scatter); ZeRO-3 reduce-scatters its partitioned gradients.
        reduce = collective_bytes("all_reduce" if stage < 3 else "reduce_scatter", g16 * n, group)
        gather = collective_bytes("all_gather", p16 * n, group)
        shard = math.ceil(n / dp)
        host_step, host_mb = ZERO, ZERO
        if layout.offload_optimizer:
            # Gradient partitions go down (every micro-batch once gradients are partitioned), params come back up.
            grads_down = LinkBytes(host=g16 * shard)
            host_step = LinkBytes(host=p16 * shard) + (grads_down if stage == 1 else ZERO)
            host_mb = ZERO if stage == 1 else grads_down
        if layout.offload_params:  # each rank fetches its partition before the forward and backward all-gathers
            host_mb += LinkBytes(host=2 * p16 * shard)
        host_params = shard if layout.offload_optimizer else 0
        # NVMe (stage 3 only): the fp32 master, momentum and variance in and out around the step; the parameter
        # partition read before forward and backward and written back after the step.
        nvme_step = 2 * 12 * shard if layout.nvme_optimizer else 0
        nvme_step += p16 * shard if layout.nvme_params else 0
        nvme_mb = 2 * p16 * shard if layout.nvme_params else 0
        syncs = (Sync(dp, 1),) if stage > 1 and dp > 1 else ()  # stages 2/3 reduce (and wait) every micro-batch
        if stage == 1:
            return CommPlan(
                mb_exposed=host_mb,
                step_bwd=reduce,
                step_exposed=gather + host_step,
                host_optimizer_parameters=host_params,
            )
        if stage == 2:
            return CommPlan(
                mb_bwd=reduce,
                mb_exposed=host_mb,
                step_exposed=gather + host_step,
                host_optimizer_parameters=host_params,
                mb_syncs=syncs,
            )
        return CommPlan(
            mb_fwd=gather,
            mb_bwd=gather + reduce,
            mb_exposed=host_mb,
            step_exposed=host_step,
            host_optimizer_parameters=host_params,
            mb_syncs=syncs,
            nvme_step_bytes=nvme_step,
            nvme_mb_bytes=nvme_mb,
        )

    def optimizer_parameters(self, shape: ModelShape, layout: Layout) -> int:
        return math.ceil(shape.num_parameters / layout.dp)

    def engine_host_seconds(
        self, shape: ModelShape, layout: Layout, workload: Workload, hw: HardwareProfile
    ) -> tuple[float, float]:
        """The ZeRO-1/2 engine's gradient hooks over the model's parameter bytes each micro-batch and its step over
        the rank's partition (the measured fixed costs and per-byte rates; 0 where not measured, offloaded or another
        stage)."""
        if layout.zero_stage not in ZERO_HOST_STAGES or layout.offload_optimizer:
            return 0.0, 0.0
        model_bytes = (4 if workload.precision == "fp32" else 2) * shape.num_parameters
        micro_batch = (hw.zero_backward_fixed_us or 0.0) * 1e-6 + model_bytes * (
            hw.zero_backward_ns_per_byte or 0.0
        ) * 1e-9
        step = (hw.zero_step_fixed_us or 0.0) * 1e-6 + model_bytes / layout.dp * (
            hw.zero_step_ns_per_byte or 0.0
        ) * 1e-9
        return micro_batch, step


def nvme_param_buffer_elements(shape: ModelShape, dp: int) -> int:
    """``offload_param.buffer_size`` under parameter offload to NVMe: DeepSpeed's 1e8 elements, or more where a
    parameter's partition would not fit one buffer (it asserts that at run time, after launch: llama-1b's 128256 x 2048
    embedding on one GPU is 262M elements). A leaf module's parameters bound its largest parameter."""
    return max(NVME_PARAM_BUFFER_ELEMENTS, math.ceil(shape.largest_module_parameters / max(dp, 1)))


def _offload_value(on: bool, nvme: bool) -> bool | str:
    """A DeepSpeed offload option as ``strategy.offload_*`` takes it: false, true (the host) or nvme."""
    return "nvme" if on and nvme else on
