"""Exit codes of ``python -m train`` (docs/reliability.md), and the exception that carries one out."""

from __future__ import annotations

from diagnostics.collect.watchdog import HANG_EXIT_CODE
from disttrain.config.errors import USER_ERROR_EXIT_CODE

SUCCESS = 0
FAILED = 1  # an exception in training, or a rank died (and no restarts were left)
USER_ERROR = USER_ERROR_EXIT_CODE  # 2: a config or input mistake, found before anything was started
HANG = HANG_EXIT_CODE  # 3: the watchdog saw no step for diagnostics.hang_timeout_s
NONFINITE = 4  # stopped on a non-finite loss or gradient (trainer.nan_policy)
# Failures a restart would only repeat: the same config, or the same data and weights at the same step.
NOT_RESTARTABLE = (USER_ERROR, NONFINITE)


class RunStopped(Exception):
    """The run ended without completing; ``pipelines/train.py`` prints ``message`` (if any) and exits with the code."""

    def __init__(self, exit_code: int, message: str = "") -> None:
        self.exit_code = exit_code
        self.message = message
        super().__init__(message or f"exit code {exit_code}")
