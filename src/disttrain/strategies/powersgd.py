"""PowerSGD for ``strategy.comm_hook=powersgd``, with state that survives DDP's bucket regrouping and a resume.

torch's ``PowerSGDState`` keys its state (each rank's error feedback, the warm-started Q factors) by *bucket
index*. DDP regroups parameters into buckets after its first step, and a resumed run starts a fresh DDP whose
first step puts every gradient in one bucket, so state saved from one layout is wrong (or crashes) in another.
``PowerSGDComm`` therefore records which parameters each bucket holds and, when a layout changes, moves the state
to a per-parameter form and back. The compression itself is torch's ``powerSGD_hook``, unchanged: per matrix it
does not depend on the bucketing, so a resumed run computes what an uninterrupted one would.

The per-parameter form is also what a checkpoint holds: one file per rank (error feedback differs per rank),
written next to the Lightning checkpoint by every rank (see ``state_path``).
"""

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, _should_compress, powerSGD_hook

STATE_FORMAT = 1


def state_path(checkpoint: str | Path, rank: int) -> Path:
    """Where ``rank`` keeps its PowerSGD state for ``checkpoint``: ``step000100.powersgd/rank00001.pt``."""
    return Path(checkpoint).with_suffix(".powersgd") / f"rank{rank:05d}.pt"


def _slices(shapes: Iterable[torch.Size], sizes: Iterable[int], flat: torch.Tensor) -> list[torch.Tensor]:
    out, offset = [], 0
    for shape, size in zip(shapes, sizes, strict=True):
        out.append(flat[offset : offset + size].clone().reshape(shape))
        offset += size
    if offset != flat.numel():
        raise RuntimeError(f"PowerSGD state of {flat.numel()} values does not match its bucket ({offset})")
    return out


class PowerSGDComm:
    """The comm-hook state handed to DDP: torch's PowerSGDState plus where each parameter sits in the buckets."""

    # What strategies/ddp.py's RankStateCheckpointing says and where it keeps the state.
    name = "PowerSGD"
    config_key = "strategy.comm_hook=powersgd"
    afresh = ", with its warm-up of plain all-reduce steps"
    state_path = staticmethod(state_path)

    def __init__(self, rank: int, warmup_steps: int, error_feedback: bool, seed: int = 0) -> None:
        self.state = PowerSGDState(
            process_group=None,  # the default group, which does not exist yet when the strategy is built
            matrix_approximation_rank=rank,
            start_powerSGD_iter=warmup_steps,
            use_error_feedback=error_feedback,
            warm_start=True,
            random_seed=seed,
        )
        self.names: dict[int, str] = {}  # id(parameter) -> name
        self.shapes: dict[str, torch.Size] = {}
        self.layouts: dict[int, tuple[str, ...]] = {}  # bucket index -> its parameters' names, in bucket order
        # Per-parameter state not yet placed in a bucket: "error" flat per parameter, "q" per compressed matrix.
        self.pending: dict[str, dict[str, torch.Tensor]] = {"error": {}, "q": {}}
        self.one_bucket_at_a_time = False

    def bind(self, model: nn.Module) -> None:
        """Called once the model is wrapped by DDP, in the process group it will reduce over."""
        self.bind_names(model)
        self.one_bucket_at_a_time = dist.get_backend() == "gloo"

    def bind_names(self, model: nn.Module) -> None:
        """Name the parameters DDP will hand the hook: the state is saved and restored under these names."""
        for name, param in model.named_parameters():
            self.names[id(param)] = name
            self.shapes[name] = param.shape

    # -- layout ---------------------------------------------------------------------------------------------
    def _matrix(self, name: str) -> tuple[int, int, int, bool]:
        """torch's view of a gradient: rows x cols, the effective rank, and whether it is compressed."""
        shape = self.shapes[name]
        n = shape[0] if len(shape) else 1
        m = max(1, int(torch.Size(shape).numel()) // max(1, n))
        r = min(n, m, self.state.matrix_approximation_rank)
        return n, m, r, _should_compress(n, m, r, self.state.min_compression_rate)[0]

    def _q_order(self, names: tuple[str, ...]) -> list[str]:
        """Compressed matrices in the order powerSGD_hook lays out its Q memory: grouped by shape, first seen first."""
        groups: dict[tuple[int, int], list[str]] = {}
        for name in names:
            n, m, _, compressed = self._matrix(name)
            if compressed:
                groups.setdefault((n, m), []).append(name)
        return [name for group in groups.values() for name in group]

    def _unpack(self, index: int, names: tuple[str, ...]) -> dict[str, dict[str, torch.Tensor]]:
        out: dict[str, dict[str, torch.Tensor]] = {"error": {}, "q": {}}
        s = self.state
        if index in s.error_dict:
            sizes = [int(torch.Size(self.shapes[n]).numel()) for n in names]
            flat = [torch.Size([size]) for size in sizes]
            out["error"] = dict(zip(names, _slices(flat, sizes, s.error_dict[index]), strict=True))
        if index in s.q_memory_dict:
            order = self._q_order(names)
            shapes = [torch.Size([self._matrix(n)[1], self._matrix(n)[2]]) for n in order]
            sizes = [shape.numel() for shape in shapes]
            out["q"] = dict(zip(order, _slices(shapes, sizes, s.q_memory_dict[index]), strict=True))
        return out

    def _pack(self, index: int, names: tuple[str, ...], like: torch.Tensor) -> None:
        s = self.state
        errors = [self.pending["error"].get(n) for n in names]
        if names and all(e is not None for e in errors):
            s.error_dict[index] = torch.cat([e.to(like) for e in errors])  # type: ignore[union-attr]
        order = self._q_order(names)
        qs = [self.pending["q"].get(n) for n in order]
        if order and all(q is not None for q in qs):
            s.q_memory_dict[index] = torch.cat([q.reshape(-1).to(like) for q in qs])  # type: ignore[union-attr]
            # P is recomputed from Q before it is read; it only has to exist so that Q is not re-randomized.
            total_p = sum(self._matrix(n)[0] * self._matrix(n)[2] for n in order)
            s.p_memory_dict[index] = torch.empty(total_p, dtype=like.dtype, device=like.device)
        for key in ("error", "q"):
            for name in names:
                self.pending[key].pop(name, None)

    def place(self, bucket: dist.GradBucket) -> None:
        """Make the state of ``bucket``'s index match the parameters it holds now."""
        index = bucket.index()
        names = tuple(self.names[id(p)] for p in bucket.parameters())
        if self.layouts.get(index) == names:
            return
        s = self.state
        if s.error_dict or s.q_memory_dict:
            # The grouping changed: every bucket's state goes back to per-parameter form, then each bucket of the
            # new grouping takes its parameters' state when it first runs.
            for key, values in self._per_parameter_live().items():
                self.pending[key].update(values)
            s.error_dict.clear()
            s.q_memory_dict.clear()
            s.p_memory_dict.clear()
            self.layouts.clear()
        self.layouts[index] = names
        self._pack(index, names, bucket.buffer())

    def _per_parameter_live(self) -> dict[str, dict[str, torch.Tensor]]:
        out: dict[str, dict[str, torch.Tensor]] = {"error": {}, "q": {}}
        for index, names in self.layouts.items():
            for key, values in self._unpack(index, names).items():
                out[key].update(values)
        return out

    # -- checkpoint -----------------------------------------------------------------------------------------
    def state_dict(self, world_size: int) -> dict[str, Any]:
        """This rank's state, per parameter (independent of DDP's bucketing); plain tensors and numbers only."""
        merged = {key: dict(values) for key, values in self.pending.items()}
        for key, values in self._per_parameter_live().items():
            merged[key].update(values)
        kind, keys, pos, has_gauss, gauss = self.state.rng.get_state()
        return {
            "format": STATE_FORMAT,
            "world_size": world_size,
            "rank": self.state.matrix_approximation_rank,
            "iter": self.state.iter,
            "rng": {"keys": torch.from_numpy(keys.astype("int64")), "pos": int(pos), "has_gauss": int(has_gauss),
                    "gauss": float(gauss), "kind": str(kind)},
            "error": merged["error"],
            "q": merged["q"],
        }  # fmt: skip

    def load_state_dict(self, saved: dict[str, Any], world_size: int) -> list[str]:
        """Restore a saved state; returns what could not be restored (and why), empty when everything was."""
        import numpy as np

        dropped = []
        s = self.state
        s.iter = int(saved["iter"])
        rng = saved["rng"]
        keys = rng["keys"].numpy().astype(np.uint32)
        s.rng.set_state((rng["kind"], keys, rng["pos"], rng["has_gauss"], rng["gauss"]))
        s.error_dict.clear()
        s.q_memory_dict.clear()
        s.p_memory_dict.clear()
        self.layouts.clear()
        error, q = dict(saved["error"]), dict(saved["q"])
        if int(saved["world_size"]) != world_size:
            # Error feedback is each rank's own residual: with a different number of ranks it belongs to no one.
            dropped.append(f"error feedback (saved by {saved['world_size']} ranks, now {world_size})")
            error = {}
        if int(saved["rank"]) != s.matrix_approximation_rank:
            dropped.append(f"warm-start factors (saved at rank {saved['rank']}, now {s.matrix_approximation_rank})")
            q = {}
        self.pending = {"error": error, "q": q}
        return dropped


def powersgd_hook(comm: PowerSGDComm, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """torch's PowerSGD hook on state that follows the parameters, not the bucket indices."""
    comm.place(bucket)
    future = powerSGD_hook(comm.state, bucket)
    if not comm.one_bucket_at_a_time:
        return future
    # powerSGD_hook issues its P and Q all-reduces from the callbacks of earlier ones. On gloo those callbacks run
    # on gloo's threads while the next bucket's hook issues its own all-reduce from autograd's thread, so ranks
    # can issue them in different orders: a collective mismatch (seen with several buckets, torch 2.13). Finishing
    # each bucket before the next starts keeps the order; gloo on CPU has little overlap to lose.
    done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    done.set_result(future.wait())
    return done
