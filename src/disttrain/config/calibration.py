"""``calibration=RUN_DIR``: a finished run's measured speeds, loaded (and checked) before anything launches."""

from __future__ import annotations

from pathlib import Path

from diagnostics.calibration import Calibration, read_calibration
from disttrain.config.errors import ConfigError
from disttrain.config.hardware import HardwareProfile


def load_calibration(path: object, hw: HardwareProfile | None = None) -> Calibration | None:
    """The run whose measured speeds replace the profile's (``calibration=RUN_DIR``), or None. With ``hw``: refused
    when it was measured on another device class (a CPU run's memory bandwidth, links and host loop are not a GPU's)."""
    if path is None:
        return None
    if not isinstance(path, str):
        raise ConfigError("calibration", f"expected a run dir, got {path!r}", "use calibration=outputs/<date>/<time>")
    try:
        calibration = read_calibration(Path(path))
    except ValueError as err:
        raise ConfigError(
            "calibration", str(err), "point calibration= at a finished run dir (or its calibration.json)"
        ) from None
    if hw is not None and calibration.accelerator not in (None, hw.accelerator):
        raise ConfigError(
            "calibration",
            f"'{path}' was measured on {calibration.accelerator}, and hw={hw.name} is a {hw.accelerator} profile",
            f"pass a run on a {hw.accelerator} machine, or hw= the profile of the machine that run used",
        )
    return calibration
