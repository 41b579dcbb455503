"""What a run's accounting needs of its model (parameters, work and FLOPs), found without allocating it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelFacts:
    """What a run's accounting needs of its model. The unit of work is the sample; a token model's samples are
    sequences of ``tokens_per_sample`` tokens with known FLOPs per token. A LightningModule's FLOPs per sample are its
    own statement, or None until they are counted at the first step."""

    num_parameters: int
    flops_per_token: float | None
    tokens_per_sample: int | None = None
    stated_flops_per_sample: float | None = None
    # False: a LightningModule that steps its optimizers itself (Lightning's manual optimization), which Lightning
    # neither accumulates nor clips for.
    automatic_optimization: bool = True

    @property
    def flops_per_sample(self) -> float | None:
        if self.stated_flops_per_sample is not None:
            return self.stated_flops_per_sample
        if self.flops_per_token is not None and self.tokens_per_sample:
            return self.flops_per_token * self.tokens_per_sample
        return None
