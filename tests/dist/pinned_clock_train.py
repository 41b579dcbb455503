"""``python -m train ARGS`` with Hydra's clock pinned to one instant: ``python pinned_clock_train.py EPOCH ARGS``.

Launches started together resolve the default run dir ``outputs/${now:%Y-%m-%d}/${now:%H-%M-%S}`` to the same
second however this 2-core box schedules their start-up (a second boundary between two of them would hide the
collision under test). Only the ``now`` resolver's clock changes; the command is the user's.
"""

from __future__ import annotations

import runpy
import sys
from datetime import datetime, tzinfo

import hydra.core.utils

PINNED = float(sys.argv[1])


class PinnedClock(datetime):
    @classmethod
    def now(cls, tz: tzinfo | None = None) -> datetime:  # type: ignore[override]
        return datetime.fromtimestamp(PINNED, tz)


hydra.core.utils.datetime = PinnedClock  # the module global the ${now:...} resolver reads at each call
sys.argv = [sys.argv[0], *sys.argv[2:]]
runpy.run_module("train", run_name="__main__", alter_sys=True)
