"""``meshpact launch --warm-start``: a node's workers and warm spares forked from one process.

:class:`WarmStart` is the agent's collaborator for it: it starts the node's
:class:`~.forkserver.ForkServer` (torch, its distributed packages and Meshpact's runtime imported
once, while the agent joins the rendezvous), waits for its imports while the agent keeps beating,
forks each worker from it (its command line run as ``python`` would), and lends it to the node's
:class:`~.sparepool.SparePool`. Where a worker cannot be forked (another interpreter, a command
other than ``python [-u] script`` or ``-m module``, a NUMA binding, an environment that sets what
torch reads at import otherwise, a server that failed) it says why in one line and the agent
starts a fresh process.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable, Sequence

from .forkserver import ForkServer, ForkServerError
from .processes import ForkedHandler, say
from .sparepool import SparePool
from .warmspare import PRELOAD, RUNTIME, runnable

__all__ = ["WarmStart"]


class WarmStart:
    """One node's fork server, as the agent uses it (see the module docstring)."""

    def __init__(self, server: ForkServer | None, spares: SparePool) -> None:
        """``server`` None: warm starts are off, and every call below starts nothing."""
        self.server = server
        self._spares = spares
        spares.forkserver = server
        self._fresh_said = False  # a worker started fresh has been said once

    @classmethod
    def start(
        cls, asked: bool, entrypoint: Any, args: Sequence[str], numa_options: Any, spares: SparePool
    ) -> "WarmStart":
        """The node's fork server started where ``asked`` (its imports run while the agent joins the
        rendezvous); none, said in a line, where this job's workers cannot be forked."""
        if not asked:
            return cls(None, spares)
        if os.path.realpath(str(entrypoint)) != os.path.realpath(sys.executable):
            say(
                f"--warm-start: the workers run {entrypoint}, not this interpreter ({sys.executable}): "
                "each starts as a fresh process"
            )
            return cls(None, spares)
        if not runnable(args) or numa_options is not None:
            why = "a NUMA binding" if numa_options is not None else f"python {' '.join(args)}"
            say(
                f"--warm-start: {why} is not a worker a fork can start (expected python [-u] script.py or "
                "python [-u] -m module): each starts as a fresh process"
            )
            return cls(None, spares)
        return cls(ForkServer((*PRELOAD, *RUNTIME), env=os.environ, share_output=True), spares)

    def await_ready(self, every_s: float, beat: Callable[[], object] | None = None) -> None:
        """Wait for the server's imports, calling ``beat`` every ``every_s`` meanwhile: on a loaded
        node they may take longer than the node-loss bound, and an agent waiting without beating
        would be judged lost. A server that failed is said, and fresh processes start from then on."""
        if self.server is None:
            return
        try:
            while not self.server.ready(every_s):
                if beat is not None:
                    beat()
        except ForkServerError as exc:
            self._give_up(f"{exc}; workers start as fresh processes")

    def fork(self, args: Sequence[str], env: dict[str, str], streams: tuple[str, str]) -> ForkedHandler | None:
        """A worker running ``python *args`` forked from the server, or None: no server, the worker's
        environment differs from the server's where torch reads it at import (said once), or the
        server failed (said; fresh processes from then on)."""
        if self.server is None:
            return None
        full = {**os.environ, **env}  # as elastic's subprocess handler builds a worker's environment
        differs = self.server.differs(full)
        if differs:
            if not self._fresh_said:
                say(
                    f"--warm-start: {', '.join(differs)} differ(s) from the fork server's, which torch read at "
                    "import: the worker starts as a fresh process"
                )
                self._fresh_said = True
            return None
        try:
            return ForkedHandler(self.server.spawn_python(args, full, streams[0], streams[1]))
        except ForkServerError as exc:
            self._give_up(f"{exc}; workers start as fresh processes from now on")
            return None

    def _give_up(self, why: str) -> None:
        say(f"--warm-start: {why}")
        self.close()

    def close(self) -> None:
        """Stop the server (every process it forked is stopped first, by the agent)."""
        if self.server is not None:
            self.server.close()
        self.server = self._spares.forkserver = None
