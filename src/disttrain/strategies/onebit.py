"""1-bit Adam's communication (``optimizer=onebit_adam``): the momentum averaged over ranks in 1 bit per value.

1-bit Adam (Tang et al., 2021, "1-bit Adam: Communication Efficient Large-Scale Training with Adam's Convergence
Speed") runs plain Adam for ``freeze_steps`` steps, then freezes Adam's variance and averages the *momentum*
instead of the gradients: each rank adds the gradient to its momentum locally, and the ranks exchange that momentum
as signs with one scale per block of values. What compression loses is kept by each rank (its *error feedback*)
and added to what it sends next step, so nothing is lost for good. DeepSpeed shipped it for its own engine and
removed it (deepspeedai/DeepSpeed#8490, gone in 0.19.8); this is a version for DDP that needs nothing beyond torch.

The exchange is DeepSpeed's two-phase scheme: every rank is the "server" of one chunk of the flat momentum.
Phase 1 (``all_to_all``): each rank compresses its momentum plus its worker error and sends chunk ``j`` to rank
``j``. Rank ``j`` averages the chunks it received, adds its server error, compresses the average again. Phase 2
(``all_gather``): every rank receives every server's compressed chunk and decompresses the whole average, so all
ranks hold the same momentum (their parameters stay identical, as under plain DDP). A rank sends about 1/8 + 4/BLOCK
bytes per value in each phase where fp32 gradients take 4 bytes (2 x (n-1)/n x 4 in a ring all-reduce).

After ``freeze_steps`` the gradients stay local: DDP's comm hook (``onebit_hook``) skips its all-reduce, and the
optimizer (``models/onebit_adam.py``) hands the momentum to ``OneBitComm.mean``. Each rank's error feedback is
its own, so it is saved per rank next to the checkpoint (``step000100.onebit/rank00001.pt``), like PowerSGD's.
"""

import math
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from disttrain.planner.comm import ONEBIT_BLOCK, onebit_exchange_bytes

STATE_FORMAT = 1
SIDECAR = ".onebit"
# Values per scale: one fp32 scale per BLOCK signs costs 4 / BLOCK bytes per value beside the 1/8 of the signs
# (3% more at 512), while a finer scale follows the momentum's magnitudes across parameters of different sizes.
# The planner prices the same payload (planner/comm.py).
BLOCK = ONEBIT_BLOCK
_SHIFTS: dict[torch.device, torch.Tensor] = {}


def _shifts(device: torch.device) -> torch.Tensor:
    """Bit positions, most significant first, kept on ``device`` (a copy from the host each call would make a GPU
    step wait for it)."""
    if device not in _SHIFTS:
        _SHIFTS[device] = torch.tensor([7, 6, 5, 4, 3, 2, 1, 0], dtype=torch.uint8, device=device)
    return _SHIFTS[device]


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    """Signs of ``x [..., 8k]`` as bits (1: >= 0), eight to a byte: uint8 ``[..., k]``."""
    bits = (x >= 0).reshape(*x.shape[:-1], -1, 8).to(torch.uint8)
    return (bits << _shifts(x.device)).sum(-1, dtype=torch.uint8)


def unpack_signs(packed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``pack_signs`` undone: +1/-1 in ``dtype``, ``[..., 8k]``."""
    bits = (packed.unsqueeze(-1) >> _shifts(packed.device)) & 1
    return bits.reshape(*packed.shape[:-1], -1).to(dtype) * 2 - 1


def compress(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., BLOCK]`` -> (packed signs ``[..., BLOCK/8]``, fp32 scale per block ``[...]``).

    The scale is the block's root mean square, so a compressed block has its input's norm (DeepSpeed's choice).
    The scale closest to ``x`` in L2, its mean absolute value, is smaller: every output falls short, the values
    larger than the scale never change sign, and their error grows without bound (a constant input compressed
    400 times with feedback: error norm 615 and still growing, against 113 and flat with the RMS)."""
    return pack_signs(x), x.float().pow(2).mean(-1).sqrt()


def decompress(signs: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return unpack_signs(signs) * scales.unsqueeze(-1)


def compress_with_feedback(x: torch.Tensor, error: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Compress ``x + error`` block-wise; ``error`` (same shape, updated in place) keeps what compression lost."""
    corrected = x + error
    signs, scales = compress(corrected)
    error.copy_(corrected - decompress(signs, scales))
    return signs, scales


def _as_bytes(signs: torch.Tensor, scales: torch.Tensor, rows: int) -> torch.Tensor:
    """One uint8 row per destination: its chunk's packed signs, then its fp32 scales' bytes."""
    return torch.cat([signs.reshape(rows, -1), scales.contiguous().view(torch.uint8).reshape(rows, -1)], dim=1)


def _from_bytes(payload: torch.Tensor, blocks: int) -> torch.Tensor:
    """``_as_bytes`` undone for rows of ``blocks`` blocks each: decompressed values ``[rows, blocks, BLOCK]``."""
    rows, sign_bytes = payload.shape[0], blocks * BLOCK // 8
    signs = payload[:, :sign_bytes].reshape(rows, blocks, BLOCK // 8)
    scales = payload[:, sign_bytes:].contiguous().view(torch.float32).reshape(rows, blocks)
    return decompress(signs, scales)


class CompressedMean:
    """The two-phase 1-bit average of one flat fp32 buffer of ``numel`` values over ``group``, with both error
    feedbacks (``worker_error``: this rank's, over the whole buffer; ``server_error``: over the chunk it serves)."""

    def __init__(self, numel: int, device: torch.device, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        distributed = dist.is_available() and dist.is_initialized()
        self.world = dist.get_world_size(group) if distributed else 1
        self.numel = numel
        self.blocks_per_chunk = max(1, math.ceil(numel / (self.world * BLOCK)))
        padded = self.world * self.blocks_per_chunk * BLOCK
        self.worker_error = torch.zeros(padded, device=device)
        self.server_error = torch.zeros(self.blocks_per_chunk * BLOCK, device=device)

    @property
    def bytes_per_phase(self) -> int:
        """What this rank hands to each of the two collectives: its whole buffer compressed."""
        return onebit_exchange_bytes(self.numel, self.world)

    def __call__(self, flat: torch.Tensor) -> torch.Tensor:
        """The approximate mean over ranks of every rank's ``flat`` (fp32, ``numel`` values); identical on every
        rank."""
        world, blocks = self.world, self.blocks_per_chunk
        padded = torch.zeros_like(self.worker_error)
        padded[: self.numel] = flat
        shape = (world, blocks, BLOCK)
        signs, scales = compress_with_feedback(padded.view(shape), self.worker_error.view(shape))
        sent = _as_bytes(signs, scales, world)
        received = torch.empty_like(sent)
        if world > 1:
            dist.all_to_all_single(received, sent, group=self.group)
        else:
            received.copy_(sent)
        # Row j: rank j's compressed values of the chunk this rank serves; their mean, compressed again.
        served = _from_bytes(received, blocks).mean(0)
        signs, scales = compress_with_feedback(served, self.server_error.view(blocks, BLOCK))
        mine = _as_bytes(signs, scales, 1)
        gathered = torch.empty((world, mine.shape[1]), dtype=torch.uint8, device=mine.device)
        if world > 1:
            dist.all_gather_into_tensor(gathered, mine, group=self.group)
        else:
            gathered.copy_(mine)
        return _from_bytes(gathered, blocks).reshape(-1)[: self.numel]


def state_path(checkpoint: str | Path, rank: int) -> Path:
    """Where ``rank`` keeps its error feedback for ``checkpoint``: ``step000100.onebit/rank00001.pt``."""
    return Path(checkpoint).with_suffix(SIDECAR) / f"rank{rank:05d}.pt"


class OneBitComm:
    """What DDP's hook and the optimizer share: the schedule (plain all-reduce until ``freeze_steps`` optimizer
    steps are done) and the compressed mean with its per-rank error feedback (created at the first compressed step,
    when the momentum's size is known)."""

    # What strategies/ddp.py's RankStateCheckpointing says and where it keeps the state.
    name = "1-bit Adam"
    config_key = "optimizer=onebit_adam"
    afresh = " with zero error feedback"
    state_path = staticmethod(state_path)

    def __init__(self, freeze_steps: int) -> None:
        self.freeze_steps = freeze_steps
        self.steps_done = 0  # optimizer steps taken (the optimizer keeps it, also across a resume)
        self.mean: CompressedMean | None = None
        self.pending: dict[str, Any] | None = None  # restored error feedback, placed at the first compressed step

    @property
    def compressing(self) -> bool:
        """Whether the step being computed (``steps_done + 1``) exchanges compressed momentum, not gradients."""
        return self.steps_done >= self.freeze_steps

    def average(self, flat: torch.Tensor) -> torch.Tensor:
        if self.mean is None or self.mean.numel != flat.numel():
            self.mean = CompressedMean(flat.numel(), flat.device)
            self._place_pending()
        return self.mean(flat)

    def _place_pending(self) -> None:
        saved, self.pending = self.pending, None
        mean = self.mean
        if saved is None or mean is None:
            return
        # Another size means another model, which a resume refuses before this: nothing to place then.
        if saved["numel"] == mean.numel and saved["worker_error"].numel() == mean.worker_error.numel():
            mean.worker_error.copy_(saved["worker_error"])
            mean.server_error.copy_(saved["server_error"])

    # -- checkpoint -----------------------------------------------------------------------------------------
    def state_dict(self, world_size: int) -> dict[str, Any]:
        """This rank's error feedback (zeros before the first compressed step)."""
        mean = self.mean
        if mean is None and self.pending is not None:
            return dict(self.pending)
        return {
            "format": STATE_FORMAT,
            "world_size": world_size,
            "numel": mean.numel if mean is not None else 0,
            "worker_error": mean.worker_error.to("cpu", copy=True) if mean is not None else torch.zeros(0),
            "server_error": mean.server_error.to("cpu", copy=True) if mean is not None else torch.zeros(0),
        }

    def load_state_dict(self, saved: dict[str, Any], world_size: int) -> list[str]:
        """Restore a saved state; returns what could not be restored (and why), empty when everything was."""
        self.mean = None
        if int(saved["world_size"]) != world_size:
            # Each rank's residual, chunked by the world it was saved in: with another world it belongs to no one.
            self.pending = None
            return [f"error feedback (saved by {saved['world_size']} ranks, now {world_size})"]
        self.pending = saved if int(saved["numel"]) > 0 else None
        return []


def onebit_hook(comm: OneBitComm, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's gradient all-reduce until ``freeze_steps``; after it, nothing: the optimizer averages the momentum."""
    if not comm.compressing:
        return default_hooks.allreduce_hook(None, bucket)  # type: ignore[arg-type]
    local: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    local.set_result(bucket.buffer())
    return local
