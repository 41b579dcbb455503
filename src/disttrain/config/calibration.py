"""``calibration=RUN_DIR``: a finished run's measured speeds, loaded (and checked) before anything launches."""

from __future__ import annotations

from pathlib import Path

from diagnostics.calibration import Calibration, read_calibration
from disttrain.config.errors import ConfigError


def load_calibration(path: object) -> Calibration | None:
    """The run whose measured speeds replace the profile's (``calibration=RUN_DIR``), or None."""
    if path is None:
        return None
    if not isinstance(path, str):
        raise ConfigError("calibration", f"expected a run dir, got {path!r}", "use calibration=outputs/<date>/<time>")
    try:
        return read_calibration(Path(path))
    except ValueError as err:
        raise ConfigError(
            "calibration", str(err), "point calibration= at a finished run dir (or its calibration.json)"
        ) from None
