"""``python -m train``: compose conf/ with Hydra and run one training job (see README); ``export=<run>`` writes
the run's weights as one file instead (disttrain/job/export.py).

Kept thin on purpose: Hydra in, typed config out, and a user's mistake becomes one line and exit code 2.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from disttrain.config.errors import USER_ERROR_EXIT_CODE, ConfigError
from disttrain.job.claim import as_override, claim_launch_dir
from disttrain.job.export import export_arguments, run_export
from disttrain.launch.console import drop_import_chatter
from disttrain.launch.exit_codes import FAILED, RunStopped
from disttrain.launch.local import rank_overrides

if TYPE_CHECKING:
    from disttrain.job.prepare import Prepared

drop_import_chatter()  # before anything here imports transformers or torchao

# Resolved through the real path so an editable install finds conf/ from any working directory.
CONF_DIR = Path(__file__).resolve().parent.parent / "conf"


def hydra_app(prepared: Prepared | None) -> None:
    """Hydra's app over sys.argv running one job; the job returns its objective (final val loss or tokens/s,
    ``objective=``) for a sweeper such as Optuna. ``prepared``: what preflight checked in this process, riding in
    the closure because Hydra's task function takes the config only (None for a multirun's jobs: each prepares its
    own)."""

    @hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="train")
    def train(cfg: DictConfig) -> float | None:
        from disttrain.job.launcher import Launcher

        hydra_cfg = HydraConfig.get()
        run_dir = Path(hydra_cfg.runtime.output_dir)
        launcher = Launcher.of_this_process(prepared, run_dir, "train", rank_overrides(hydra_cfg))
        try:
            # GPU ranks import torch/Lightning while this process does; CPU ranks are forked after it has.
            launcher.start_before_imports()
            from disttrain.job.run import run_from_hydra  # imported late: torch/Lightning only for valid commands

            launcher.start_after_imports()
            return run_from_hydra(cfg, launcher)
        except ConfigError as err:
            print(f"disttrain: config error: {err}", file=sys.stderr)
            sys.exit(USER_ERROR_EXIT_CODE)
        except RunStopped as stop:  # a run that ended without completing (a crash, a non-finite stop, failed restarts)
            if stop.message:
                print(stop.message, file=sys.stderr)
            if stop.exit_code == FAILED and HydraConfig.get().mode == RunMode.MULTIRUN:
                raise  # one failed job of a sweep: Hydra records it, runs the other jobs, then ends with the failure
            sys.exit(stop.exit_code)
        finally:
            launcher.discard()  # ranks started early for a job that ended before it took them

    train()


def cli(argv: list[str] | None = None) -> None:
    """Check the command before Hydra creates a run dir (see disttrain.job.preflight), claim the dir (a launch in
    the same second gets another: disttrain.job.claim), then run it there."""
    from disttrain.job.preflight import cluster_rank_job, preflight

    argv = sys.argv[1:] if argv is None else argv
    if joining := cluster_rank_job(argv):  # Hydra's main reads sys.argv
        sys.argv[1:] = argv = [*argv, *joining]
    try:
        if (export := export_arguments(argv)) is not None:  # export=<run or checkpoint>: no training, no ranks
            for path in run_export(export, CONF_DIR):
                print(f"exported {path}")
            return
        checked = preflight(argv, CONF_DIR)
        if (launch := checked.launch_dir) is not None:  # Hydra's main reads sys.argv: it runs in the claimed dir
            sys.argv[1:] = [*argv, as_override(launch.key, claim_launch_dir(launch))]
    except ConfigError as err:
        print(f"disttrain: config error: {err}", file=sys.stderr)
        sys.exit(USER_ERROR_EXIT_CODE)
    hydra_app(checked.prepared)


if __name__ == "__main__":
    from disttrain.launch.process_exit import run_then_exit

    # Not a plain return: leaked process-group threads can abort a finished run at teardown (process_exit.py).
    run_then_exit(cli)
