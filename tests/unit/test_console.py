"""Library log lines and Python warnings reach the run's log file once and the console not at all."""

from __future__ import annotations

import io
import logging
import warnings
from pathlib import Path

import pytest

from disttrain.launch.console import route_library_output_to_log_file


@pytest.fixture
def hydra_like_logging(tmp_path: Path):
    """Root with a console and a file handler (Hydra's job logging) and Lightning's own stream handler."""
    root, library = logging.getLogger(), logging.getLogger("lightning.pytorch")
    saved = (root.handlers[:], root.level, library.handlers[:], library.propagate)
    console, own = io.StringIO(), io.StringIO()
    file_handler = logging.FileHandler(tmp_path / "train.log")
    root.handlers = [logging.StreamHandler(console), file_handler]
    root.setLevel(logging.INFO)
    library.handlers = [logging.StreamHandler(own)]
    yield console, own, tmp_path / "train.log"
    logging.captureWarnings(False)
    file_handler.close()
    logging.getLogger("py.warnings").handlers = []
    logging.getLogger("py.warnings").propagate = True
    root.handlers, root.level, library.handlers, library.propagate = saved[0], saved[1], saved[2], saved[3]


def test_library_info_and_warnings_go_to_the_file_once(hydra_like_logging) -> None:
    console, own, log_file = hydra_like_logging
    route_library_output_to_log_file()
    logging.getLogger("lightning.pytorch.utilities.rank_zero").info("GPU available: False")
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.warn("some library is deprecated", DeprecationWarning, stacklevel=1)
    logging.getLogger("disttrain.anything").warning("a real problem")
    for handler in logging.getLogger().handlers:
        handler.flush()
    text = log_file.read_text()
    assert text.count("GPU available: False") == 1 and text.count("DeprecationWarning: some library is deprecated") == 1
    assert own.getvalue() == ""  # Lightning's own handler is gone
    assert console.getvalue().splitlines() == ["a real problem"]  # warnings and above still reach the console


def test_import_chatter_is_dropped_and_the_same_libraries_other_warnings_are_not() -> None:
    from disttrain.launch.console import IMPORT_CHATTER, drop_import_chatter

    drop_import_chatter()
    drop_import_chatter()  # twice: one filter each
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    for name, fragments in IMPORT_CHATTER.items():
        logger = logging.getLogger(name)
        assert len(logger.filters) == 1
        logger.addHandler(handler)
        try:
            for fragment in fragments:
                logger.warning("Warning: %s /x/_C_kernel.so", fragment)
            logger.warning("%s: a real problem", name)
        finally:
            logger.removeHandler(handler)
    assert stream.getvalue().splitlines() == [f"{name}: a real problem" for name in IMPORT_CHATTER]
