"""The console shows the run's own lines once; library chatter goes to the run's log file.

Lightning adds its own stream handler to its loggers and Hydra adds a console handler to the root logger, so
every Lightning INFO line ("GPU available", the litlogger tip, "`Trainer.fit` stopped") printed twice, and
third-party deprecation warnings printed once per rank. After Hydra has configured logging, this keeps one
console handler (WARNING and above) and routes library INFO lines and Python warnings to the log file Hydra
opened (RUN_DIR/<job name>.log). The run's own lines (``say``) are prints and are not affected.
"""

from __future__ import annotations

import logging
import os

LIBRARY_LOGGERS = ("lightning", "lightning.pytorch", "lightning.fabric")


def _console(handler: logging.Handler) -> bool:
    return isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler)


def route_library_output_to_log_file() -> None:
    # Kineto (the profiler window) prints "USDT: ... profiler_start/stop" from C++ straight to the console on every
    # rank; its levels below 6 all include those lines. A user's own KINETO_LOG_LEVEL wins.
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    root = logging.getLogger()
    files = [h for h in root.handlers if isinstance(h, logging.FileHandler)]
    for name in LIBRARY_LOGGERS:
        library = logging.getLogger(name)
        for handler in [h for h in library.handlers if _console(h)]:
            library.removeHandler(handler)
        library.propagate = True  # to the root's file handler (and its console handler, for warnings)
    for handler in root.handlers:
        if _console(handler):
            handler.setLevel(logging.WARNING)
    if files:  # without a log file (no Hydra job), warnings keep their usual place on stderr
        logging.captureWarnings(True)
        warnings_logger = logging.getLogger("py.warnings")
        warnings_logger.propagate = False
        for handler in files:
            if handler not in warnings_logger.handlers:
                warnings_logger.addHandler(handler)
