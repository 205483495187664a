"""Replacing a failed worker: which exits get a new process, where its files go, what is left gone.

A worker that exits 0 has finished. A worker that exits with an error is replaced alone, in place
(same rank, the next incarnation), while a replacement is left on this node (``--max-restarts``
replacement processes per node; torchrun's agent counts restarts of the whole group instead) and
the agent's own rule allows it, and it did not refuse a recovery that cannot happen (it left
a marker, :mod:`~meshpact.live.recovery.refusal`: a new process would hold nothing and decide
the same); else it is left gone and the job is told so
(:class:`~meshpact.live.launch.gone.GoneRanks`). A replacement's output and error file go
beside its first process's, in ``<local rank>.<incarnation>/``. The group's end is when every
worker has finished or is gone: succeeded where any finished (elastic's records name the gone
ones' failures), failed otherwise.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from ..recovery.refusal import read_refusal
from .processes import Running

__all__ = ["Ledger", "Replacements"]


@dataclass
class Ledger:
    """The agent's record of its workers: what each runs, which finished, which are gone."""

    running: dict[int, Running] = field(default_factory=dict)  # local rank -> its process
    finished: set[int] = field(default_factory=set)  # local ranks whose process exited 0
    gone: dict[int, ProcessFailure] = field(default_factory=dict)  # local rank -> the failure it was left with
    replaced: int = 0

    def watched(self) -> dict[int, Running]:
        """The local ranks neither finished nor gone, and their processes."""
        return {lr: r for lr, r in self.running.items() if lr not in self.finished and lr not in self.gone}


class Replacements:
    """One node's replacement decisions and its ledger (see the module docstring)."""

    def __init__(self, budget: int) -> None:
        self.budget = budget  # --max-restarts: replacement processes on this node
        self.remaining = budget
        self.ledger = Ledger()
        self.attempt_dir: Path | None = None  # elastic's log folder of this attempt (None: no files kept)
        self.streams: dict[int, tuple[str, str]] = {}  # local rank -> (stdout, stderr) of its first process
        self._markers: Path | None = None  # the folder of the processes' refusal markers (made when first named)

    def exits(self) -> list[tuple[int, ProcessFailure]]:
        """Collect the workers that exited since the last look: a 0 is recorded finished; each failure is
        returned, (local rank, its failure), for the caller to replace or leave gone."""
        failed = []
        for lr, running in self.ledger.watched().items():
            rc = running.handler.proc.poll()
            if rc is None:
                continue
            running.close()
            if rc == 0:
                self.ledger.finished.add(lr)
            else:
                failed.append((lr, ProcessFailure(lr, running.pid, rc, running.error_file)))
        return failed

    def marker_of(self, local_rank: int, incarnation: int) -> Path:
        """Where ``local_rank``'s process of ``incarnation`` leaves its refusal, if it refuses a recovery
        that cannot happen (:mod:`~meshpact.live.recovery.refusal`)."""
        if self._markers is None:
            self._markers = Path(tempfile.mkdtemp(prefix="meshpact-refusals-"))
        return self._markers / f"{local_rank}.{incarnation}"

    def refusal(self, local_rank: int) -> str | None:
        """The line ``local_rank``'s last process left refusing a recovery (None: it failed otherwise)."""
        if self._markers is None:  # no process was given a marker (or the folder is gone with close): none refused
            return None
        running = self.ledger.running[local_rank]
        return read_refusal(self.marker_of(local_rank, running.incarnation))

    def close(self) -> None:
        if self._markers is not None:
            shutil.rmtree(self._markers, ignore_errors=True)
            self._markers = None

    def allowed(self) -> bool:
        return self.remaining > 0

    def next_incarnation(self, local_rank: int) -> int:
        return self.ledger.running[local_rank].incarnation + 1

    def files_of(self, local_rank: int, incarnation: int) -> tuple[str, str, str]:
        """(stdout, stderr, error file) of a replacement: beside the first process's, in ``<rank>.<k>/``."""
        if self.attempt_dir is None:
            return "", "", os.devnull
        d = self.attempt_dir / f"{local_rank}.{incarnation}"
        d.mkdir(parents=True, exist_ok=True)
        out, err = self.streams[local_rank]
        return (str(d / "stdout.log") if out else "", str(d / "stderr.log") if err else "", str(d / "error.json"))

    def replaced(self, local_rank: int, running: Running) -> None:
        """``running`` is ``local_rank``'s replacement (one of the budget spent)."""
        self.remaining -= 1
        self.ledger.running[local_rank] = running
        self.ledger.replaced += 1

    def left_gone(self, local_rank: int, failure: ProcessFailure) -> None:
        self.ledger.gone[local_rank] = failure

    def why_not(self) -> str:
        """Why a failed worker was left gone, for the agent's line."""
        return f"left (--max-restarts {self.budget})" if self.remaining <= 0 else "started for this exit"

    def end(self, wg: WorkerGroup) -> RunResult | None:
        """The group's result once every worker finished or is gone (None: some still run)."""
        ledger = self.ledger
        if len(ledger.finished) + len(ledger.gone) < len(wg.workers):
            return None
        failures = {wg.workers[lr].global_rank: f for lr, f in ledger.gone.items()}
        if ledger.finished:  # the gone ranks' failures too: elastic's records name every worker of the group
            return RunResult(
                state=WorkerState.SUCCEEDED,
                return_values={wg.workers[lr].global_rank: None for lr in sorted(ledger.finished)},
                failures=failures,
            )
        return RunResult(state=WorkerState.FAILED, failures=failures)
