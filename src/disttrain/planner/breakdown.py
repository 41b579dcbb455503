"""What one GPU holds, term by term: the shape every strategy's memory terms return (``planner/terms``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes on one GPU. ``step_temporaries`` exist only in the optimizer step, after activations are freed."""

    params: int
    grads: int
    optimizer_states: int
    activations: int
    buffers: int
    step_temporaries: int = 0
    host: int = 0  # offloaded states kept in host memory for this GPU's rank (not part of ``total``)
    nvme: int = 0  # ZeRO-Infinity: offloaded states swapped to NVMe for this GPU's rank (not part of ``total``)
    # Gradients allocated in backward as it frees the activations (no persistent gradient buffer): then they are
    # not held beside all the activations at backward's start.
    grads_in_backward: bool = False

    @property
    def total(self) -> int:
        """The predicted peak: model states plus the larger of (activations + buffers) and step temporaries; where
        ``grads_in_backward``, the gradients join the step temporaries' side instead of the states."""
        if self.grads_in_backward:
            working = max(self.activations + self.buffers, self.grads + self.step_temporaries)
            return self.params + self.optimizer_states + working
        states = self.params + self.grads + self.optimizer_states
        return states + max(self.activations + self.buffers, self.step_temporaries)

    def to_json(self) -> dict[str, int]:
        keys = {
            "params": self.params,
            "grads": self.grads,
            "optimizer_states": self.optimizer_states,
            "activations": self.activations,
            "buffers": self.buffers,
            "total": self.total,
            "host": self.host,
        }
        return {**keys, "nvme": self.nvme} if self.nvme else keys  # only ZeRO-Infinity layouts swap to NVMe
