"""Hang detection by heartbeat over the control channel, independent of the data-path timeout.

Each rank runs one background thread with its own connection to the control ``TCPStore``.
Every ``heartbeat_interval_s`` it does two things:

- *beat*: it adds to this rank's counter: one for "this thread ran", and :data:`PROGRESS`
  more when the main thread progressed since the last look: it is outside the watched
  training step, or waiting in torch's communication code, or moved (frame or bytecode
  offset), or spent CPU time, or is runnable (waiting for a CPU, not for an event). A rank
  waiting on its peers progresses; a rank inside one long native operation spends CPU time
  or is runnable; a rank whose step stopped (asleep, blocked on a lock) does not.
- *watch*: it reads every peer's counter (one round trip each) and judges it with
  :func:`watch`: a peer whose thread ran without its main thread progressing, for
  ``heartbeat_misses`` looks, is stalled. A peer whose counter did not move at all was not
  scheduled (a loaded machine) or is frozen whole: no evidence either way, and the data-path
  timeout bounds that case. The thread then shuts down this rank's data-path sockets (the
  same severing the runtime does on a fault), so a collective waiting on the stalled peer
  fails now instead of at the data-path timeout, and the runtime recovers.

The bound on finding a stall is :attr:`RecoveryConfig.heartbeat_detect_s`. Not found by the
heartbeat (the data-path timeout still bounds them): a main thread busy without moving (a
spin loop in native code) and a process that stops whole (every thread, e.g. SIGSTOP).
Counting a peer that was not scheduled as silent raised false alarms on a loaded machine
(6 in 10 minutes at load average 24 on 2 cores).
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any

from . import communicator as comm
from .control import ControlChannel, control_address

__all__ = ["Heartbeat", "PROGRESS", "watch"]

PROGRESS = 1 << 20  # a beat's weight for "the main thread progressed"; the low bits count "the thread ran"
_BUSY_S = 1e-4  # main-thread CPU time between two looks that counts as progress (a sleeping thread spends none)


def watch(seen: int, now: int, still: int) -> int:
    """A peer's looks without progress so far (``still``), updated from its counter at the last
    look (``seen``) and now: back to 0 when it progressed, one more when its thread ran without
    progress, unchanged when nothing moved (it was not scheduled: no evidence)."""
    if now // PROGRESS > seen // PROGRESS:
        return 0
    if now % PROGRESS > seen % PROGRESS:
        return still + 1
    return still


class Heartbeat:
    """One rank's beating and watching thread (see the module docstring)."""

    def __init__(self, session: Any, modules: tuple[str, ...]) -> None:
        cfg = session.config
        self.session = session
        self.interval_s = cfg.heartbeat_interval_s
        self.misses = cfg.heartbeat_misses
        self.modules = modules  # torch's communication code: a main thread waiting here is not stalled
        host, port, _ = control_address()
        self.channel = ControlChannel(host, port, session.rank, session.world_size, cfg.control_timeout_s,
                                      is_host=False, connect_timeout_s=cfg.store_connect_s,
                                      run_id=session.spec.run_id)
        self.watching = False  # set by the runtime while the user's step runs
        self.detected_wall: float | None = None  # when this rank's watch found a stalled peer
        self.stalled: tuple[int, ...] = ()
        self._detected_generation: int | None = None
        self._main = threading.main_thread().ident
        self._main_stat = f"/proc/self/task/{threading.main_thread().native_id}/stat"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="meshpact-heartbeat", daemon=True)

    def start(self) -> "Heartbeat":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=max(1.0, 4 * self.interval_s))

    def take(self) -> tuple[float | None, tuple[int, ...]]:
        """This generation's detection (wall time, stalled ranks), cleared; one made for an
        earlier generation is dropped."""
        out = (self.detected_wall, self.stalled) if self._detected_generation == self.session.generation else (None, ())
        self.detected_wall, self.stalled, self._detected_generation = None, (), None
        return out

    def _main_cpu_s(self) -> float:
        """CPU time the main thread has used (a native operation in progress spends it)."""
        try:
            return time.clock_gettime(time.pthread_getcpuclockid(self._main))  # type: ignore[arg-type]
        except (OSError, AttributeError, TypeError):
            return time.monotonic()  # no per-thread clock here: every look counts as progress

    def _main_runnable(self) -> bool:
        """The main thread is running or waiting for a CPU (state R), not for an event."""
        try:
            with open(self._main_stat, "rb") as fh:
                return fh.read().rpartition(b")")[2].split()[0] == b"R"
        except (OSError, IndexError):
            return False

    def _main_position(self) -> tuple[int, int, bool]:
        frame = sys._current_frames().get(self._main)
        if frame is None:
            return (0, 0, True)
        waiting = False
        f: Any = frame
        while f is not None:
            if f.f_code.co_filename.startswith(self.modules):
                waiting = True
                break
            f = f.f_back
        return (id(frame.f_code), frame.f_lasti, waiting)

    def _run(self) -> None:
        world = self.session.world_size
        me = self.session.rank
        keys = [f"heartbeat/rank{r}" for r in range(world)]
        last_pos = self._main_position()
        last_cpu = self._main_cpu_s()
        seen: list[int] | None = None
        still = [0] * world
        while not self._stop.wait(self.interval_s):
            generation = self.session.generation
            pos = self._main_position()
            cpu = self._main_cpu_s()
            progressed = (not self.watching or pos[2] or pos[:2] != last_pos[:2] or cpu - last_cpu >= _BUSY_S
                          or self._main_runnable())
            self.channel.add(keys[me], 1 + (PROGRESS if progressed else 0))
            last_pos, last_cpu = pos, cpu
            counts = [self.channel.counter(k) for k in keys]
            if not self.watching or seen is None:
                still = [0] * world
                seen = counts
                continue
            still = [0 if r == me else watch(seen[r], counts[r], still[r]) for r in range(world)]
            stalled = [r for r in range(world) if still[r] >= self.misses]
            seen = counts
            s = self.session
            # the step may have failed meanwhile and new groups be in the making: sever only
            # the generation this look was made in, while the step still runs
            if stalled and self.detected_wall is None and self.watching and s.generation == generation:
                self.detected_wall, self.stalled, self._detected_generation = time.time(), tuple(stalled), generation
                comm.sever(s.data_sockets())  # the standby's sockets survive
                still = [0] * world
