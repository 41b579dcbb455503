"""Bytes handed to collectives, read from a Chrome trace that torch.profiler recorded with ``record_shapes``.

This counts at the process-group level, so it sees what actually went to the backend whatever produced it:
DDP's built-in all-reduce, a comm hook's compressed buckets, PowerSGD's P/Q factors, the loss all-reduce of
logging. On gloo each collective is a ``gloo:<op>`` event whose ``Input Dims``/``Input type`` give the payload;
NCCL collectives carry ``In msg nelems``/``dtype`` on their ``record_param_comms`` host event.

The number is the payload (the input tensors' bytes), not the wire traffic: a ring all-reduce moves about
2(n-1)/n of the payload per rank, the same factor for every hook, so ratios between runs are ratios of traffic.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

# Element sizes by the names the profiler gives dtypes: C++ type names (gloo's Input type) and NCCL's dtype names.
DTYPE_BYTES = {
    "double": 8, "float": 4, "c10::BFloat16": 2, "c10::Half": 2, "long int": 8, "int": 4, "short int": 2,
    "signed char": 1, "unsigned char": 1, "bool": 1,
    "Double": 8, "Float": 4, "BFloat16": 2, "Half": 2, "Long": 8, "Int": 4, "Short": 2, "Char": 1, "Byte": 1,
    "Bool": 1,
}  # fmt: skip


def profiler_options(all_threads: bool = True) -> dict[str, Any]:
    """torch.profiler arguments under which every collective's payload is recorded.

    ``record_shapes`` puts the tensor sizes on the events. ``profile_all_threads``: collectives issued from a
    future's callback (PowerSGD's P and Q all-reduces run on gloo's threads) are otherwise not recorded at all,
    which undercounted PowerSGD by half in a 2-rank test. Only runs that issue collectives there need it
    (``all_threads``): in a 3-repeat interleaved A/B (DDP, 100 steps) the window with it left the median step at
    410.8 ms, without it 391.2, diagnostics=off 389.6.
    """
    import torch

    options: dict[str, Any] = {"record_shapes": True}
    if not all_threads:
        return options
    config = getattr(torch.profiler, "_ExperimentalConfig", None)
    # An older torch without the option still records the threads it propagates the profiler to.
    if config is not None:
        with contextlib.suppress(TypeError):
            options["experimental_config"] = config(profile_all_threads=True)
    return options


def _gloo_bytes(args: dict[str, Any]) -> int:
    dims, types = args.get("Input Dims") or [], args.get("Input type") or []
    total = 0
    for shape, dtype in zip(dims, types, strict=False):
        size = DTYPE_BYTES.get(str(dtype))
        if size is not None and isinstance(shape, list) and all(isinstance(d, int) for d in shape):
            total += size * math.prod(shape)
    return total


def collective_bytes(trace: dict[str, Any]) -> dict[str, int]:
    """Payload bytes per collective (``all_reduce``, ``all_gather``, ...) over a whole exported trace."""
    gloo: dict[str, int] = {}
    nccl: dict[str, int] = {}
    for event in trace.get("traceEvents", []):
        name, args = str(event.get("name", "")), event.get("args") or {}
        if name.startswith("gloo:"):
            op = name[len("gloo:") :]
            gloo[op] = gloo.get(op, 0) + _gloo_bytes(args)
        elif name == "record_param_comms" and event.get("cat") == "cpu_op" and "In msg nelems" in args:
            # Only the host event: the GPU kernel repeats the same arguments.
            op = str(args.get("Collective name", "unknown"))
            size = DTYPE_BYTES.get(str(args.get("dtype")), 0)
            nccl[op] = nccl.get(op, 0) + size * int(args["In msg nelems"])
    found = nccl or gloo
    return {op: value for op, value in sorted(found.items()) if value > 0}
