"""A node's warm spares: which waiting interpreter a failed worker's rank is promoted into.

``--spare-ranks-per-node N`` keeps N interpreters per node (:mod:`~meshpact.live.launch.warmspare`,
torch imported) started by the agent. :class:`SparePool` starts them, notes once when each has
finished its imports, and decides which one a rank is promoted into: a ready one first, else any
still alive (it finishes its imports, then runs the rank), else none (the agent starts a new
process). A promotion is one file written (:func:`~meshpact.live.launch.warmspare.assign`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from torch.distributed.elastic.multiprocessing.subprocess_handler import get_subprocess_handler

from .forkserver import ForkServer, ForkServerError
from .processes import ForkedHandler, say
from .warmspare import Assignment, assign, ready_path

__all__ = ["SparePool"]


@dataclass
class _Spare:
    handler: Any  # elastic's SubprocessHandler
    assignment: Path
    started: float  # monotonic time it was started
    ready: bool = False  # its imports are done (:func:`~meshpact.live.launch.warmspare.ready_path` exists)


class SparePool:
    """The warm interpreters waiting on one node (see the module docstring)."""

    def __init__(self) -> None:
        self._dir: Path | None = None  # the spares' assignment files: made with the first spare, removed by clear
        self.forkserver: ForkServer | None = None  # where spares are forked from (--warm-start), else fresh
        self.waiting: list[_Spare] = []
        self.started = 0  # how many were ever started (each has its own assignment file)

    def __len__(self) -> int:
        return len(self.waiting)

    def start(self) -> int:
        """Start one more warm interpreter; its pid."""
        index = self.started
        self.started += 1
        if self._dir is None:
            self._dir = Path(tempfile.mkdtemp(prefix="meshpact-spares-"))
        path = self._dir / f"spare-{index}.json"
        env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        handler: Any = None
        if self.forkserver is not None and self.forkserver.accepts({**os.environ, **env}):
            try:
                handler = ForkedHandler(self.forkserver.spawn_spare(str(path), {**os.environ, **env}))
            except ForkServerError as exc:
                say(f"warm spare {index}: {exc}; started as a fresh interpreter")
        if handler is None:
            handler = get_subprocess_handler(
                sys.executable, ("-u", "-m", "meshpact.live.launch.warmspare", str(path)), env, "", "", index, None
            )
        self.waiting.append(_Spare(handler, path, time.monotonic()))
        return int(handler.proc.pid)

    def promote(self, env: dict[str, str], args: Sequence[str], streams: tuple[str, str]) -> Any | None:
        """Give a waiting interpreter a rank (its environment, the worker's arguments, its output files):
        its process handler, or None where no spare is alive."""
        alive = [s for s in self.waiting if s.handler.proc.poll() is None]
        spare = next((s for s in alive if s.ready or ready_path(s.assignment).exists()), alive[0] if alive else None)
        if spare is None:
            return None
        self.waiting.remove(spare)
        assign(spare.assignment, Assignment(env, tuple(str(a) for a in args), *streams))
        return spare.handler

    def note_ready(self) -> None:
        """Say once when each spare has finished importing (from then on a promotion starts the script at once)."""
        for s in self.waiting:
            if not s.ready and ready_path(s.assignment).exists():
                s.ready = True
                say(
                    f"warm spare pid {s.handler.proc.pid} is ready ({time.monotonic() - s.started:.1f} s after its "
                    "start)"
                )

    def procs(self) -> list[subprocess.Popen]:
        return [s.handler.proc for s in self.waiting]

    def clear(self) -> None:
        """Forget the waiting spares (stopped by the caller) and remove their files' folder (every agent
        used to leave one behind, empty, in the temporary directory)."""
        self.waiting = []
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
