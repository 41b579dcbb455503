"""Text for the user's loggers: a mid-run finding, the final report. Scalars go through ``Logger.log_metrics``;
text has no common Lightning interface, so each logger that can hold it gets it its own way (TensorBoard text,
a wandb alert or artifact) and the CSV logger gets only the scalars."""

from __future__ import annotations

from pathlib import Path

from lightning.pytorch.loggers import Logger, TensorBoardLogger, WandbLogger


def log_text(loggers: list[Logger], tag: str, text: str, step: int) -> None:
    """``text`` under ``tag`` at ``step`` in each TensorBoard run (its TEXT tab)."""
    for logger in loggers:
        if isinstance(logger, TensorBoardLogger):
            logger.experiment.add_text(tag, text, global_step=step)


def alert(loggers: list[Logger], title: str, text: str, critical: bool) -> None:
    """A wandb alert (an offline run keeps it for ``wandb sync``), where the run logs to wandb."""
    for logger in loggers:
        if isinstance(logger, WandbLogger):
            import wandb

            level = wandb.AlertLevel.ERROR if critical else wandb.AlertLevel.WARN
            logger.experiment.alert(title=title[:63], text=text, level=level, wait_duration=0)


def attach_report(loggers: list[Logger], run_dir: Path, step: int) -> list[str]:
    """RUN_DIR/report/ to each logger that can hold it: an artifact of the wandb run, report.md as TensorBoard
    text (the TEXT tab renders its markdown). Returns the kinds of logger it went to."""
    report_md = run_dir / "report" / "report.md"
    attached = []
    for logger in loggers:
        if isinstance(logger, WandbLogger):
            import wandb

            artifact = wandb.Artifact(f"diagnostics-report-{logger.experiment.id}", type="diagnostics-report")
            artifact.add_dir(str(run_dir / "report"))
            logger.experiment.log_artifact(artifact)
            attached.append("wandb run (artifact)")
        elif isinstance(logger, TensorBoardLogger) and report_md.is_file():
            logger.experiment.add_text("diagnostics/report", report_md.read_text(encoding="utf-8"), global_step=step)
            logger.experiment.flush()
            attached.append("TensorBoard run (text)")
    return attached
