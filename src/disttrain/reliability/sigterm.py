"""SIGTERM agreed in the non-finite guard's per-step vote, not in Lightning's per-batch broadcast.

Lightning (2.5+) broadcasts rank 0's SIGTERM flag at the start of every batch when the world has more than one rank:
a collective and a host read per micro-batch (on a GPU a device sync the host cannot run ahead of), beside the
guard's own vote; and its SIGTERM handler issues one more broadcast from inside the handler, wherever in its step
the rank happens to be (a collective the other ranks are not in at that point: a SIGTERM to rank 1 alone hung a
2-rank run), while its end-of-batch check stops a rank on its own flag before the others know. Here the handler
only sets this rank's own flag, which rides in the guard's vote (one all-reduce per optimizer step that runs
anyway); a flag on any rank sets Lightning's on every rank, and Lightning's end-of-batch check then ends ``fit``
with ``SIGTERMException`` on all of them after the same batch. The vote is a maximum, so a flag is the rank plus
one: every rank learns which rank was signalled (the highest, if several were), and the launcher records that
one. Before the first vote Lightning's broadcast of rank 0's flag stays (a strategy whose engine skipped the hook
would keep it throughout): every rank has seen the same number of votes at any batch, so all of them call it or
none does. A signal that comes after the last vote (in the final validation or checkpoint) lets the run finish;
one during a validation is acted on at the next step's vote.
"""

from __future__ import annotations

from collections.abc import Callable
from types import FrameType
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities.exceptions import SIGTERMException


class SigtermInVote(pl.Callback):
    """Puts this rank's SIGTERM flag in the guard's vote; install by adding it to ``NonFiniteGuard.riders`` too."""

    def __init__(self) -> None:
        self.votes = 0
        self.installed = False
        self.received = False  # this rank's own flag; Lightning's (``received_sigterm``) is only set once agreed
        self.signalled_rank: int | None = None  # agreed by every rank: the (highest) rank that received SIGTERM
        self._connector: Any = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # Before Trainer._run registers its signal handlers, which bind ``_sigterm_notifier_fn`` as it is then.
        connector = getattr(trainer, "_signal_connector", None)
        loop = trainer.fit_loop.epoch_loop
        broadcast = getattr(loop, "_broadcast_sigterm_tensor", None)
        if stage != "fit" or broadcast is None or connector is None or not hasattr(connector, "_sigterm_notifier_fn"):
            return  # another Lightning: its own mechanism, untouched
        self._connector = connector
        connector._sigterm_notifier_fn = self._notify
        loop._broadcast_sigterm_tensor = self._before_batch(broadcast)
        self.installed = True

    def _notify(self, signum: int, frame: FrameType | None) -> None:
        """Lightning's handler without its broadcast (a signal handler is no place for a collective), and without
        setting Lightning's flag: its end-of-batch check would stop this rank alone, before the others know."""
        launcher = self._connector.trainer.strategy.launcher
        if not self.received and launcher is not None:
            launcher.kill(signum)
        self.received = True

    def _before_batch(self, broadcast: Callable[[], None]) -> Callable[[], None]:
        def maybe_broadcast() -> None:
            if self.votes:
                return  # the votes carry it
            # Before the first vote: Lightning's broadcast of rank 0's flag, the same batch on every rank.
            self._connector.received_sigterm = self.received
            try:
                broadcast()
            except SIGTERMException:
                self.signalled_rank = 0
                raise
            finally:
                self._connector.received_sigterm = self.signalled_rank is not None

        return maybe_broadcast

    def flag(self, trainer: pl.Trainer) -> float:
        """This rank's part of the vote: its global rank plus one if it received SIGTERM, else 0."""
        return float(trainer.global_rank + 1) if self.installed and self.received else 0.0

    def agreed(self, trainer: pl.Trainer, highest: float) -> None:
        """The vote's verdict (the maximum over the ranks), the same on every rank."""
        if not self.installed:
            return
        self.votes += 1
        if highest > 0 and self.signalled_rank is None:
            self.signalled_rank = int(highest) - 1
            self._connector.received_sigterm = True  # Lightning ends fit after this batch, on every rank


def signalled_rank(riders: list[Any]) -> int | None:
    """The rank whose SIGTERM every rank agreed to stop for, if the guard's vote carried one."""
    return next((r.signalled_rank for r in riders if isinstance(r, SigtermInVote)), None)
