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

# Lines libraries log about nothing the run uses, most while they are imported: torchao (which transformers' modeling
# code imports for its quantizers) warns for each optional C++ kernel a CPU-only or other-version torch cannot load
# and that triton is absent, and torch's pytree warns about the enums torchao registers. Each process of an HF or
# fp8 run printed them. DeepSpeed's engine, once built, warns that ZeRO runs an "untested" optimizer whenever it is
# not one of DeepSpeed's own: every run's optimizer is a torch one (ours or the user's configure_optimizers'),
# chosen on purpose (strategies/deepspeed.py allows it), so the line says nothing to act on.
IMPORT_CHATTER = {
    "torchao": ("Failed to load ",),
    "torchao.kernel.intmm": ("Detected no triton",),
    "torch.utils._pytree": ("is an Enum subclass and is now natively supported",),
    "DeepSpeed": ("You are using ZeRO with an untested optimizer",),
}


class _DropImportChatter(logging.Filter):
    def __init__(self, fragments: tuple[str, ...]) -> None:
        super().__init__()
        self.fragments = fragments

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(fragment in message for fragment in self.fragments)


def drop_import_chatter() -> None:
    """Before anything imports the libraries: their loggers (created here if not yet) drop the lines above, and
    only those; their other warnings still show. Idempotent."""
    for name, fragments in IMPORT_CHATTER.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropImportChatter) for f in logger.filters):
            logger.addFilter(_DropImportChatter(fragments))


def _console(handler: logging.Handler) -> bool:
    return isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler)


def route_library_output_to_log_file() -> None:
    # Kineto (the profiler window) prints "USDT: ... profiler_start/stop" from C++ straight to the console on every
    # rank; its levels below 6 all include those lines. A user's own KINETO_LOG_LEVEL wins.
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    # A log file on a disk that fills or vanishes mid-run must not print a "--- Logging error ---" traceback for every
    # record that follows: the run's own failure path names the cause once.
    logging.raiseExceptions = False
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
