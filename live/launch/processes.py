"""Worker processes as an agent sees them: the process a local rank runs now, and how it is stopped.

Every agent (:class:`~meshpact.live.launch.elastic.ReplacingAgent`, the spare node's, the one run
inside another program) keeps one :class:`Running` per local rank, signals a worker's whole process
group (a worker's children go with it), says what it decided in one line on its stderr
(:func:`say`), and waits in a store's native code only on a thread of its own (:func:`stoppable`),
so a scheduler's SIGTERM is heard at once.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

__all__ = [
    "ForkedHandler",
    "Running",
    "signal_group",
    "kill",
    "say",
    "stoppable",
    "wait_any",
    "stop",
    "handle_death_signals",
]

_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")  # torchrun's, unless TORCHELASTIC_SIGNALS_TO_HANDLE says


@dataclass
class Running:
    """The process a local rank has now (its first, a replacement, or a promoted spare)."""

    handler: Any  # torch.distributed.elastic's SubprocessHandler
    incarnation: int
    error_file: str
    warm: bool = False
    _pidfd: int | None = field(default=None, repr=False)

    @property
    def pid(self) -> int:
        return int(self.handler.proc.pid)

    def pidfd(self) -> int | None:
        """A descriptor that turns readable when the process exits (None where the kernel has no pidfds)."""
        if self._pidfd is None and hasattr(os, "pidfd_open"):
            try:
                self._pidfd = os.pidfd_open(self.pid)
            except OSError:  # already reaped, or no pidfd support
                return None
        return self._pidfd

    def close(self) -> None:
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None


class ForkedHandler:
    """A process forked by a :class:`~.forkserver.ForkServer`, as elastic's subprocess handler is used
    here (``proc``, and ``close`` with a death signal to its process group)."""

    def __init__(self, proc: Any) -> None:
        self.proc = proc

    def close(self, death_sig: signal.Signals | None = None) -> None:
        if self.proc.poll() is None:
            signal_group(self.proc, death_sig or signal.SIGTERM)


def signal_group(proc: subprocess.Popen, sig: int) -> None:
    """Send ``sig`` to ``proc``'s process group (each worker leads its own), or to ``proc`` alone."""
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        try:
            proc.send_signal(sig)
        except ProcessLookupError:
            pass


def kill(proc: subprocess.Popen) -> None:
    signal_group(proc, signal.SIGKILL)


def say(line: str, who: str = "meshpact launch") -> None:
    """One line of what the agent (or ``who``) decided, on its stderr (where torchrun's agent logs)."""
    sys.stderr.write(f"[{who}] {line}\n")
    sys.stderr.flush()


def stoppable(wait: Callable[[], None]) -> None:
    """Run ``wait`` (a rendezvous, a spare node's standing by) on a thread of its own and look every
    0.2 s whether it ended, so that the agent stays stoppable: a store waits in native code, where
    Python runs no signal handler until it returns (SIGTERM or Ctrl-C was held until the join
    timeout, 600 s by default). A signal ends the agent as at any other point, and the waiting
    thread goes with the process; what ``wait`` raised is raised here."""
    done: list[BaseException | None] = []

    def run() -> None:
        try:
            wait()
            done.append(None)
        except BaseException as exc:  # noqa: BLE001 (re-raised on the agent's own thread)
            done.append(exc)

    waiter = threading.Thread(target=run, name="meshpact-rendezvous", daemon=True)
    waiter.start()
    while waiter.is_alive():
        waiter.join(0.2)
    if done and done[0] is not None:
        raise done[0]


def wait_any(running: Iterable[Running], timeout_s: float) -> None:
    """Sleep ``timeout_s``, or less: until one of ``running`` exits (its pidfd turns readable), so a
    death is acted on when it happens rather than at the next look."""
    fds = [fd for r in running if (fd := r.pidfd()) is not None]
    if not fds:
        time.sleep(timeout_s)
        return
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    if poller.poll(timeout_s * 1000):  # an exit: a forked worker's is known once its server reports it
        time.sleep(0.002)


def stop(procs: Sequence[subprocess.Popen], death_sig: int, timeout_s: float) -> None:
    """Send ``death_sig`` to every process still running, and SIGKILL those not gone within ``timeout_s``."""
    for proc in procs:
        if proc.poll() is None:
            signal_group(proc, death_sig)
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        try:
            proc.wait(max(deadline - time.monotonic(), 0.01))
        except subprocess.TimeoutExpired:
            kill(proc)


def handle_death_signals() -> None:
    """As torchrun's agent: a death signal to the agent ends its workers (elastic's ``SignalException``)."""
    from torch.distributed.elastic.multiprocessing.api import _terminate_process_handler

    for name in os.environ.get("TORCHELASTIC_SIGNALS_TO_HANDLE", ",".join(_SIGNALS)).split(","):
        sig = getattr(signal, name.strip(), None)
        if sig is not None:
            signal.signal(sig, _terminate_process_handler)
