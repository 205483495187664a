"""Hang detection by heartbeat over the control channel, independent of the data-path timeout.

Each rank runs one background thread with its own connection to the control ``TCPStore``.
Every ``heartbeat_interval_s`` it does two things:

- *beat*: it adds to this rank's counter: one for "this thread ran", and :data:`PROGRESS`
  more when the main thread progressed since the last look (:func:`progressed`): it is
  outside the watched training step, or waiting in torch's communication code, or waiting for
  torch's compiler (its worker processes, the C++ compiler it runs), or moved
  (frame or bytecode offset), or spent CPU time, or is runnable (waiting for a CPU) or in
  the kernel's uninterruptible wait (faulting pages in, reclaiming memory), or it is in
  torch's code while the process's native threads (torch's intra-op pool, the communication
  library's) spent CPU time: it waits for them. Native CPU time while the main thread is in
  the user's own code (asleep in ``time.sleep``, on a lock) is not its work. A rank waiting on its peers progresses; a rank inside one
  long native operation spends CPU time on its own thread or on its pool's; a rank whose
  step stopped (asleep, blocked on a lock) does none of these. At real sizes a step's
  optimizer update runs for seconds on the intra-op pool while the main thread sleeps: a
  healthy rank in a long step, which a main-thread-only rule called stalled.
- *watch*: it reads the counters of the few peers it watches (:func:`watched_peers`: its next
  :data:`WATCH_FANOUT` members on the ring, one round trip; every rank is watched by as many, so
  a look's store work does not grow with the job) and judges each with
  :func:`watch`: a peer whose thread ran without its main thread progressing, for more looks
  than the job's own steps show (:func:`stall_bound`), is stalled. A peer whose counter did not move at all was not
  scheduled (a loaded machine) or is frozen whole: no evidence either way, and the data-path
  timeout bounds that case. The thread then shuts down this rank's data-path sockets (the
  same severing the runtime does on a fault), so a collective waiting on the stalled peer
  fails now instead of at the data-path timeout, and the runtime recovers.

A step may wait on something that is not communication and still be healthy: a queue its data
comes from, a disk, a rate limit. Such a wait does not progress by the rule above, so the bound
follows the job as the data-path timeout does: each rank counts the longest run of looks without
progress inside a step that then completed (its *usual pause*) and publishes it when it grows; a
peer is stalled after ``max(heartbeat_misses, stall_margin x usual pause)`` looks, and not before
the process's second completed step (the first, the warm-up, builds and compiles: no evidence; the
first steps' data-path timeout, the warm-up bound, covers them). A step that waited 0.4 s on a queue, judged by a fixed three looks, was severed on
every attempt until the job gave up.

A partitioned data link is no stall: every rank's main thread waits in torch's
communication code, which counts as progress. So each look also asks whether this rank's
data path is *quiet*: the main thread waits in communication code, no thread of the process
(but this one) is running, runnable or in the kernel's uninterruptible wait (faulting a buffer's
pages in, reclaiming memory: it is about to move bytes), and not a byte moved on the data path's
sockets since the last look (the kernel's per-socket counts, ``TCP_INFO``). Each rank publishes how many looks in a
row it was quiet, with its beat number. One rank, the *quiet judge* (:func:`quiet_judge`), reads
every word while it is quiet itself; when every rank of the job says it was quiet for
``heartbeat_misses`` looks, and every one of those words is fresh (its beat moved since the
judge's last look), the collective they all wait in can never finish (a cut link, or ranks
waiting in different collectives): the judge severs its data path as for a stall and says so
in its own word at once, and every other quiet rank, which reads only the judge's word, severs
its own at its next look. A rank still
computing, a rank whose bytes move (a large collective under way), a rank whose thread was
not scheduled (a stale word) each keep the alarm off. Only where the data path is sockets
(gloo); NCCL's traffic does not pass through them, so there the data-path timeout finds it.

A rank that starts a recovery shuts down only its own reading (:func:`~.communicator.sever`): its
peers hear nothing on their sockets, so it sets a key on the control channel for each of them
(:func:`recovering_key`). Each rank's listener thread waits on its own key (one blocking wait on a
connection of its own) and, the moment it is set, severs this rank's data path once the rank is in
a step: a rank blocked in a collective on any pair, a send to a third rank included, fails then,
not at the data-path timeout (a second by default, minutes where NCCL-length timeouts are set). A
rank still in the step before the failed one (the key names it) finishes that step first, while
its data path moves. A rank told so has every member told already (the first rank sets every
member's key at once), so it tells nobody itself. Through the rank's own recovery the listener
sleeps, and it waits on the next generation's key once that recovery ended
(:meth:`Heartbeat.recovery_begins`, :meth:`Heartbeat.recovery_ends`): a peer's key set meanwhile
is found at once then. A listener nobody told (its rank told the others) is ended then by the
rank setting its own key.

Why not shut both directions down and let the peers read the end of the stream, as a killed
rank's kernel does: gloo's TCP transport never fails a collective's send (an unbound buffer's)
that it queued on a pair because the kernel refused it, nor a receive it was part way through,
when the pair then fails (``Pair::signalException``, ``gloo/transport/tcp/pair.cc``); such an
operation waits out its whole timeout, and ``ProcessGroupGloo.abort`` and ``shutdown`` do not end
it. A peer's write is refused once this end has sent a FIN and stopped reading (the kernel answers
the data with a reset): 1 to 4 recoveries in 100 at 4 and 8 ranks waited out the timeout that way
on a loaded 2-core machine. A sever that only stops this rank's reading, waits for what its own
sockets are still sending, and drains what the peers still send, leaves no rank in that wait.
Not avoided: a receive a rank was part way through when its own sever came (its step was already
failing), and a send part way through to a rank that was killed.

The bound on finding a stall or a quiet data path is :attr:`RecoveryConfig.heartbeat_detect_s`.
Not found by the heartbeat (the data-path timeout still bounds them): a main thread busy
without moving (a spin loop in native code) and a process that stops whole (every thread,
e.g. SIGSTOP).
Counting a peer that was not scheduled as silent raised false alarms on a loaded machine
(6 in 10 minutes at load average 24 on 2 cores).
"""

from __future__ import annotations

import atexit
import math
import os
import socket
import struct
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from .blocks import AT_STEP, point_order
from .communicator import Severance
from .control import ControlChannel, ControlTimeout
from .device import DeviceProgress

__all__ = [
    "Heartbeat",
    "HeartbeatAlarm",
    "recovering_key",
    "PROGRESS",
    "watch",
    "all_quiet",
    "QuietWord",
    "Look",
    "progressed",
    "device_moved",
    "stall_bound",
    "pause_key",
    "watched_peers",
    "quiet_judge",
    "quiet_key",
    "WATCH_FANOUT",
]

PROGRESS = 1 << 20  # a beat's weight for "the main thread progressed"; the low bits count "the thread ran"
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep  # torch's own code: an op the main thread waits in
# where a main thread waits for torch's compiler working on its behalf: the compile workers' futures, and the C++
# compiler inductor runs as a child process (the work is done, but in other processes: no CPU of this one moves)
_COMPILE_WAITS = tuple(
    os.path.join(_TORCH_DIR, "_inductor", m)
    for m in ("async_compile.py", "codecache.py", "cpp_builder.py", "compile_worker" + os.sep)
)
_BUSY_S = 1e-4  # main-thread CPU time between two looks that counts as progress (a sleeping thread spends none)


_TCP_INFO_LEN = 232  # struct tcp_info up to tcpi_bytes_received (Linux >= 4.1)
_BYTES_AT = 120  # tcpi_bytes_acked, then tcpi_bytes_received (two u64)


@dataclass(frozen=True)
class HeartbeatAlarm:
    """What the heartbeat found: when, the stalled ranks (a stall), that every rank's data path
    went quiet (``data_path_quiet``: a cut link or a hang of the collective itself), or neither:
    a peer opened a recovery while this rank was still in the step."""

    t_wall: float
    stalled: tuple[int, ...] = ()
    data_path_quiet: bool = False
    detail: str = ""  # what the look saw (each stalled rank's looks and bound, each rank's quiet word)


@dataclass(frozen=True)
class SeverTiming:
    """When a heartbeat's sever of the data path ended, how long it waited for the session's sever
    lock (a recovery's rebuild holds it) and how long the sever itself took (its flush of a large
    message part way included): what a rank that learned of a fault late spent it on."""

    alarm: "HeartbeatAlarm | None" = None  # the alarm this sever was for
    t_wall: float = 0.0
    lock_wait_s: float = 0.0
    sever_s: float = 0.0
    severance: Severance = field(default_factory=lambda: Severance(0))  # the sever's own record: how its flush ended


@dataclass(frozen=True)
class QuietWord:
    """What a rank publishes each look: its beat number, how many looks in a row its data path
    was quiet (see the module docstring), and the generation in which it found every rank
    quiet (-1: none). A rank that found it severs only its own sockets, and across a cut link
    that tells nobody on the other side: they read it here and sever theirs."""

    beat: int
    quiet: int
    hung: int = -1

    def encode(self) -> str:
        return f"{self.beat}:{self.quiet}:{self.hung}"

    @classmethod
    def decode(cls, raw: bytes | str) -> "QuietWord | None":
        try:
            beat, quiet, hung = (raw.decode() if isinstance(raw, bytes) else raw).split(":")
            return cls(int(beat), int(quiet), int(hung))
        except (ValueError, UnicodeDecodeError):
            return None


def all_quiet(words: dict[int, "QuietWord | None"], last_beats: dict[int, int], misses: int) -> bool:
    """Every rank's word is fresh (its beat moved since the previous read, ``last_beats``) and
    says its data path was quiet for at least ``misses`` looks in a row. A rank with no word,
    one not read before, or a stale one keeps the alarm off: no evidence is no alarm."""
    return bool(words) and all(
        w is not None and r in last_beats and w.beat != last_beats[r] and w.quiet >= misses for r, w in words.items()
    )


@dataclass(frozen=True)
class Look:
    """What one look saw of the main thread (and the threads working for it) since the last."""

    watching: bool  # the user's step runs
    in_comm: bool  # the main thread's stack is in torch's communication code
    moved: bool  # its frame or bytecode offset changed
    main_cpu_s: float  # CPU seconds the main thread spent
    state: str  # its scheduler state now (R running or runnable, S sleeping, D uninterruptible...)
    native_cpu_s: float  # CPU seconds the process's threads not run by Python spent
    in_torch: bool = False  # the main thread's innermost frame is torch's code (an op the pool may run)
    compiling: bool = False  # it waits for torch's compiler (its worker processes, the C++ compiler it runs)
    # on a device (CUDA): whether a step fence completed since the last look; None on the CPU
    device_moved: bool | None = None


def progressed(look: Look) -> bool:
    """Whether the main thread progressed since the last look (the module docstring's rule). On a
    device the host's CPU time, position and scheduler state say nothing (a host spinning in a
    CUDA call behind a hung kernel has all three): there the step progressed when a fence of its
    device work completed (:class:`~.device.DeviceProgress`), or the host waits in torch's
    communication code or its compiler, as on the CPU."""
    if look.device_moved is not None:
        return not look.watching or look.in_comm or look.compiling or look.device_moved
    return (
        not look.watching
        or look.in_comm
        or look.compiling
        or look.moved
        or look.main_cpu_s >= _BUSY_S
        or look.state in ("R", "D")
        or (look.in_torch and look.native_cpu_s >= _BUSY_S)
    )


def device_moved(progress: DeviceProgress | None, last: int) -> tuple[bool | None, int]:
    """Whether ``progress`` (None on the CPU) counted a fence completed since it counted ``last``,
    and its count now: a look's :attr:`Look.device_moved`."""
    if progress is None:
        return None, last
    now = progress.count()
    return now > last, now


def watch(seen: int, now: int, still: int) -> int:
    """A peer's looks without progress so far (``still``), updated from its counter at the last
    look (``seen``) and now: back to 0 when it progressed, one more when its thread ran without
    progress, unchanged when nothing moved (it was not scheduled: no evidence)."""
    if now // PROGRESS > seen // PROGRESS:
        return 0
    if now % PROGRESS > seen % PROGRESS:
        return still + 1
    return still


def stall_bound(usual_pause: int | None, misses: int, margin: float) -> int | None:
    """Looks without progress after which a rank whose completed steps paused at most
    ``usual_pause`` looks in a row is stalled (None: it completed no step yet; no alarm)."""
    if usual_pause is None:
        return None
    return max(misses, math.ceil(margin * usual_pause))


# how many ring successors each rank watches: every rank is watched by as many, so a stall is seen
# as soon as before, and a look reads WATCH_FANOUT counters whatever the job's size
WATCH_FANOUT = 2


def watched_peers(me: int, members: Sequence[int], fanout: int = WATCH_FANOUT) -> tuple[int, ...]:
    """The peers ``me`` watches: the next ``fanout`` members after it on the ring of ``members``
    (every other member where there are no more). Each member is watched by ``fanout`` others, so
    the watch stays a few counters a look at any scale, and a stalled rank is still seen by
    ``fanout`` peers, each of which severs and starts the recovery that tells every member."""
    ring = sorted(members)
    if me not in ring:
        return tuple(r for r in ring if r != me)[:fanout]
    at = ring.index(me)
    n = min(fanout, len(ring) - 1)
    return tuple(ring[(at + 1 + i) % len(ring)] for i in range(n))


def quiet_judge(members: Sequence[int]) -> int:
    """The rank that reads every rank's quiet word and judges whether all are quiet (the lowest
    member); the others read only its word, whose ``hung`` names a generation it found hung. The
    store work of the quiet rule is then one word a look for each rank and the job's size for one."""
    return min(members)


def quiet_key(rank: int) -> str:
    """Where ``rank`` publishes its :class:`QuietWord`."""
    return f"heartbeat/quiet/rank{rank}"


def pause_key(rank: int) -> str:
    """Where ``rank`` publishes its usual pause (see the module docstring)."""
    return f"heartbeat/pause/rank{rank}"


def beat_key(rank: int) -> str:
    """The control-channel counter ``rank``'s heartbeat adds to at every look (an observer
    reading it sees the rank beat when it moves)."""
    return f"heartbeat/rank{rank}"


_LISTEN_S = 3600.0  # one wait on the control channel (renewed; ended by a recovery or by stop)
_LISTEN_POLL_S = 0.002  # how often a rank heard of a recovery checks whether its step began
_LISTEN_STOP_S = 0.05  # how often, waiting for its recovery to end, the listener looks whether it is stopped
# a rank told of a recovery while still in the step before the failed one lets that step finish while
# its data path moves (see _listen); nothing moved this long, it is severed (the step waits on a rank
# that is gone, or only computes now)
_BEHIND_QUIET_S = 0.02


def recovering_key(generation: int, rank: int) -> str:
    """The control-channel key a rank that starts a recovery out of ``generation`` sets for each
    other member ``rank`` (a rank told of it already sets none, a drill none): the rank's
    heartbeat waits on it and severs its data path the moment it is set. A rank whose listener
    still waits on it once its recovery ended sets its own (:meth:`Heartbeat.recovery_ends`)."""
    return f"recovering/g{generation}/rank{rank}"


class Heartbeat:
    """One rank's beating and watching thread (see the module docstring)."""

    # on a device (CUDA): the fences of the rank's steps, whose completion is its progress (None: the CPU's rule)
    device_progress: DeviceProgress | None = None

    def __init__(self, session: Any, modules: tuple[str, ...]) -> None:
        cfg = session.config
        self.session = session
        self.interval_s = cfg.heartbeat_interval_s
        self.misses = cfg.heartbeat_misses
        self.stall_margin = cfg.stall_margin
        self._pause = 0  # looks in a row the main thread has not progressed, in the step under way
        self._step_pause = 0  # the longest such run in the step under way
        self.usual_pause: int | None = None  # the longest in a step that completed (None: none completed yet)
        self.allowance = 0  # the longest pause of the failed attempt of the step being run again
        self.steps_completed = 0  # by this process (its first, the warm-up, teaches no usual pause)
        self._stall_detail = ""  # what the last look found stalled, for the alarm's record
        self._forget_word = False  # set by warm_up_again: the thread publishes "no word" at its next look
        self.modules = modules  # torch's communication code: a main thread waiting here is not stalled
        if session.ops.kind == "cuda":
            self.device_progress = session.progress
        self.channel = ControlChannel(
            session.control.host,
            session.control.port,
            session.rank,
            session.world_size,
            cfg.control_timeout_s,
            is_host=False,
            connect_timeout_s=cfg.store_connect_s,
            run_id=session.spec.run_id,
            key=session.control.key,
        )
        self.watching = False  # set by the runtime while the user's step runs
        self.running_step = -1  # the step the runtime runs (or ran last), set with step_begins
        self.running_block = AT_STEP  # the block between steps it runs before that step (blocks.py), or AT_STEP
        self.alarm: HeartbeatAlarm | None = None  # what this rank's watch found, once per generation
        self._detected_generation: int | None = None
        self._alarm_lock = threading.Lock()  # an alarm is kept only while the step it ends still runs
        self.last_look_wall = 0.0  # when the thread last looked (a recovery says how long ago)
        self.failed_looks = 0  # looks that raised (each is skipped; the thread goes on)
        self.last_failure = ""
        # the quiet-data-path rule needs the data path's bytes in the kernel's socket counts
        self.quiet_rule = session.spec.backend == "gloo" and hasattr(socket, "TCP_INFO")
        self._fds: dict[int, str] = {}
        self._fds_generation: int | None = None
        self._main = threading.main_thread().ident
        self._main_stat = f"/proc/self/task/{threading.main_thread().native_id}/stat"
        self.listener = ControlChannel(
            session.control.host,
            session.control.port,
            session.rank,
            session.world_size,
            cfg.control_timeout_s,
            is_host=False,
            connect_timeout_s=cfg.store_connect_s,
            run_id=session.spec.run_id,
            key=session.control.key,
        )
        self.opened_wall = 0.0  # when a peer's recovery of this rank's generation was last heard of
        self._told: int | None = None  # the generation a peer's recovery was heard of in (it told every member)
        self._heard: int | None = None  # the generation whose key the listener last heard (a peer's or its own)
        self._recovering: int | None = None  # the generation this rank's own recovery leaves, while it runs
        self._recovered = threading.Event()  # set when this rank's recovery ends: the listener waits again
        self.last_sever = SeverTiming()  # how the last sever by an alarm (the watch's or the listener's) spent its time
        self._listening = session.generation  # the generation whose key the listener waits on
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="meshpact-heartbeat", daemon=True)
        self._listener = threading.Thread(target=self._listen, name="meshpact-recovery-listener", daemon=True)

    def start(self) -> "Heartbeat":
        self.clear_pause_word()
        self._thread.start()
        self._listener.start()
        # the listener waits inside the store client's native code: the interpreter must not
        # finalize while it does (a thread coming back then is ended mid-stack and aborts the
        # process), so an exit that skipped stop() ends it first
        atexit.register(self.stop)
        return self

    def stop(self) -> None:
        atexit.unregister(self.stop)
        self._stop.set()
        rank = self.session.rank
        try:  # end the listener's wait (it stops on its own key; nobody else reads it)
            self.channel.set_many(
                sorted({recovering_key(g, rank) for g in (self._listening, self.session.generation)}), -1
            )
        except Exception:  # noqa: BLE001 (the control channel is gone: so is the listener's wait)
            pass
        self._thread.join(timeout=max(1.0, 4 * self.interval_s))
        self._listener.join(timeout=max(1.0, 4 * self.interval_s))

    def clear_pause_word(self) -> None:
        """Publish "no usual pause" for this rank before it runs a step: the word a process that
        held this rank before (a killed one, replaced) published lives on in the store, and peers
        judged the replacement's first steps (building, its first all-gathers) by the old
        process's steady pauses. Its warm-up teaches no usual pause, and until it completes a
        second step no bound applies to it (``peek`` reads the null as no word)."""
        self.channel.set(pause_key(self.session.rank), None)

    def warm_up_again(self) -> None:
        """The rank's model was built anew (an excision's smaller world: ``build(mesh)``, FSDP's
        lazy initialisation and buffers of the new sizes, a compiled step compiled again): its
        next step is a warm-up, as the process's first was. What its old model's steps paused
        bounds nothing now; peers judge it again from its second completed step on the new model.
        The word it published is replaced by "no word" at the thread's next look (the thread is
        the one writer of it, so no look of its own can put the old word back)."""
        self.steps_completed = 0
        self.usual_pause = None
        self.allowance = 0
        self._forget_word = True

    def step_begins(self, again: bool = False, step: int = -1) -> None:
        """The runtime is about to run a step, or (``again``) run it again after a recovery: its
        pauses are counted afresh, and a step run again may pause as long as its failed attempt
        did. A pause that belongs to the step (an evaluation inside it) comes back in every run of
        it and would be called a stall on each; a stall does not (its attempt is not run again
        with it), and the allowance ends with the step."""
        self.allowance = max(self.allowance, self._step_pause) if again else 0
        self._pause = self._step_pause = 0
        self.running_step = step
        self.running_block = AT_STEP

    def step_completed(self) -> None:
        """The step ran to its end: its longest pause is one a healthy step of this job makes. The
        process's first step is not counted (building, compiling, a loader's workers starting: its
        waits are the warm-up's, as the data-path timeout's fit leaves it out too)."""
        self.steps_completed += 1
        if self.steps_completed > 1:
            self.usual_pause = max(self.usual_pause or 0, self._step_pause)
        self.allowance = 0

    def pause_word(self) -> int | None:
        """What this rank publishes: the longest pause a peer is to allow it now (None: no step
        completed yet, no alarm)."""
        return None if self.usual_pause is None else max(self.usual_pause, self.allowance)

    def _stalled(self, ranks: tuple[int, ...], still: list[int]) -> list[int]:
        """The ranks whose looks without progress (``still``) passed their bound: each rank with at
        least ``heartbeat_misses`` of them has its pause word read (one round trip for all), as it
        is now (a word can shrink: a step run again allows more until it ends)."""
        ask = [r for i, r in enumerate(ranks) if still[i] >= self.misses]
        if not ask:
            return []
        at = {r: i for i, r in enumerate(ranks)}
        words = self.channel.peek([pause_key(r) for r in ask])
        bounds = {
            r: stall_bound(int(raw), self.misses, self.stall_margin) for r, raw in zip(ask, words) if raw is not None
        }
        out = [r for r, b in bounds.items() if b is not None and still[at[r]] >= b]
        self._stall_detail = "; ".join(
            f"rank {r}: {still[at[r]]} looks without progress, bound {bounds[r]} "
            f"(usual pause {int(words[ask.index(r)])})"
            for r in out
        )
        return out

    def recovery_begins(self, generation: int) -> None:
        """This rank starts a recovery out of ``generation``: its listener, told or told later,
        severs nothing and sleeps until :meth:`recovery_ends`."""
        self._recovering = generation

    def recovery_ends(self) -> None:
        """This rank's recovery ended (resumed, or failed into the next one): the listener waits
        on the key of the generation the rank is in now. One still waiting on the key of a
        generation the rank has left (nobody told this rank: it told the others) is ended by
        this rank setting its own key, here, after the first collective: set as the recovery
        began, it woke the listener in the middle of it."""
        left, self._recovering = self._recovering, None
        self._recovered.set()
        # the generation it left, and the one the listener waits on (it may not have stored the
        # generation it read yet: both), unless heard already or still the rank's
        stale = {
            g for g in (left, self._listening) if g is not None and g not in (self._heard, self.session.generation)
        }
        if stale:
            rank = self.session.rank
            try:
                self.session.control.set_many([recovering_key(g, rank) for g in sorted(stale)], {"rank": rank})
            except Exception:  # noqa: BLE001 (the control channel is gone: the job is ending, the listener with it)
                pass

    def told_of(self, generation: int) -> bool:
        """Whether a peer's recovery of ``generation`` reached this rank's listener: that peer
        set every member's key, so this rank need tell nobody."""
        return self._told == generation

    def take(self) -> HeartbeatAlarm | None:
        """This generation's alarm, cleared; one raised in an earlier generation is dropped."""
        with self._alarm_lock:
            out = self.alarm if self._detected_generation == self.session.generation else None
            self.alarm, self._detected_generation = None, None
        return out

    def _alarmed(self, generation: int) -> bool:
        """Whether an alarm of ``generation`` waits to be taken (one of an earlier generation, kept
        because its step ended before it was raised, counts as none: it must not keep this
        generation's alarm from being raised)."""
        return self.alarm is not None and self._detected_generation == generation

    def _raise(self, alarm: HeartbeatAlarm, generation: int) -> None:
        """Keep ``alarm`` for the runtime and sever the data path of ``generation`` (unless the
        generation moved on meanwhile), so the step in flight fails at once. A step that ended
        since this look began (its recovery may have taken the alarms already) keeps none."""
        s = self.session
        with self._alarm_lock:
            if not self.watching or self._alarmed(generation):  # the other thread (watch, listener) raised first
                return
            self.alarm, self._detected_generation = alarm, generation
        t0 = time.perf_counter()
        with s.sever_lock:  # the standby's sockets survive, and a swap under way is waited for
            t1 = time.perf_counter()
            if s.generation == generation:
                severance = s.sever_data_path(tell_peers=False)
                self.last_sever = SeverTiming(alarm, time.time(), t1 - t0, time.perf_counter() - t1, severance)

    def _listen(self) -> None:
        """Wait on the control channel (a connection of its own) for a peer opening a recovery of
        this rank's generation (:func:`recovering_key`), and sever this rank's data path the moment
        one does, once the rank is in a step: a rank blocked in a collective whose peers shut down
        only their reading hears nothing on its sockets.

        The key says at which step the peer failed (and at which block between steps, :mod:`.blocks`).
        A rank still in the step or block before it (the
        step's last collective ends at different times on each rank: the peer finished it and
        began the next, this rank is still receiving its last pieces) lets that step finish
        while its data path moves, and severs once it runs the failed step: cut, its step would
        fail one step behind the others, the ranks' committed steps would differ, and the job
        would restore its checkpoint instead of resuming from memory. It is severed as before
        once its data path moved nothing for ``_BEHIND_QUIET_S`` (its step waits on a rank that
        is gone: a kill's survivors are not held), after the data-path timeout in all, or at
        once where the data path's bytes cannot be read (:meth:`_data_bytes`). Ends with the
        job's control channel or with :meth:`stop` (which sets this rank's own key)."""
        s = self.session
        while not self._stop.is_set():
            generation = self._listening = s.generation
            key = recovering_key(generation, s.rank)
            try:
                told = self.listener.wait([key], timeout_s=_LISTEN_S)[key]
            except ControlTimeout:
                continue
            except Exception:  # noqa: BLE001 (the control channel is gone: the job is ending)
                return
            self.opened_wall, self._heard = time.time(), generation
            self._recovered.clear()  # set when the recovery out of this generation ends
            if isinstance(told, dict) and told.get("rank") != s.rank:  # (its own key: this rank told the others)
                self._told = generation
            failed_step = told.get("step") if isinstance(told, dict) else None
            failed_at = point_order((failed_step, told.get("block", AT_STEP))) if failed_step is not None else None
            moved, moved_at, held_at = None, time.monotonic(), time.monotonic()
            while (
                not self._stop.is_set()
                and s.generation == generation
                and not self._alarmed(generation)
                and self._recovering != generation
            ):  # (recovering already: its step has failed)
                behind = (
                    self.watching
                    and failed_at is not None
                    and point_order((self.running_step, self.running_block)) < failed_at
                )
                if behind:  # finishing the step before the failed one: held while its bytes move
                    now, seen = time.monotonic(), self._data_bytes(generation)
                    if seen != moved:
                        moved, moved_at = seen, now
                    behind = seen is not None and now - moved_at < _BEHIND_QUIET_S and now - held_at < s.spec.timeout_s
                if (
                    self.watching and not behind
                ):  # a step of this generation runs: it may be blocked on a pair nobody severs
                    self._raise(
                        HeartbeatAlarm(time.time(), (), detail=f"a peer opened a recovery of generation {generation}"),
                        generation,
                    )
                    if self._alarmed(generation) or self._recovering == generation:
                        break  # (raised, or its step failed meanwhile)
                    # the step ended as the alarm was raised (nothing severed, no alarm kept): the next
                    # step of this generation waits on the recovering peer, and is severed once it runs
                time.sleep(_LISTEN_POLL_S)  # between steps, or finishing the one before the failed one
            # asleep through the recovery, woken once it ended (its first collective ran), not as it
            # advances: a thread woken in the middle of a recovery takes CPU and the GIL from it
            while not self._stop.is_set() and (s.generation == generation or self._recovering is not None):
                if self._recovered.wait(_LISTEN_STOP_S):
                    self._recovered.clear()  # a recovery that failed before it advanced: the next one ends it

    def _data_bytes(self, generation: int) -> int | None:
        """Bytes acknowledged plus received on the data path's sockets (None: none to read).
        The sockets are listed once per generation (a recovery builds new ones)."""
        if self._fds_generation != generation:
            self._fds = self.session.data_sockets()
            self._fds_generation = generation
        total, read = 0, 0
        for fd in self._fds:
            try:
                with socket.socket(fileno=os.dup(fd)) as dup:
                    info = dup.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_LEN)
            except OSError:
                continue
            if len(info) >= _BYTES_AT + 16:
                acked, received = struct.unpack_from("=QQ", info, _BYTES_AT)
                total, read = total + acked + received, read + 1
        return total if read else None

    def _others_working(self) -> bool:
        """A thread of this process other than this one is running or waiting for a CPU, or in
        the kernel's uninterruptible wait (faulting in the pages of a buffer it is about to send
        or receive into, reclaiming memory, waiting on a write-back): it may be about to move
        bytes, so the data path is not quiet. A thread asleep (waiting on a socket, a lock) is not."""
        me = threading.get_native_id()
        try:
            tasks = os.listdir("/proc/self/task")
        except OSError:
            return True
        for tid in tasks:
            if int(tid) == me:
                continue
            try:
                with open(f"/proc/self/task/{tid}/stat", "rb") as fh:
                    if fh.read().rpartition(b")")[2].split()[0] in (b"R", b"D"):
                        return True
            except (OSError, IndexError):
                continue
        return False

    def _main_cpu_s(self) -> float:
        """CPU time the main thread has used (a native operation in progress spends it)."""
        try:
            return time.clock_gettime(time.pthread_getcpuclockid(self._main))  # type: ignore[arg-type]  # None: the TypeError below
        except (OSError, AttributeError, TypeError):
            return time.monotonic()  # no per-thread clock here: every look counts as progress

    def _main_state(self) -> str:
        """The main thread's scheduler state (``R``: running or waiting for a CPU; ``D``: an
        uninterruptible wait in the kernel; ``S``: asleep, waiting for an event)."""
        try:
            with open(self._main_stat, "rb") as fh:
                return fh.read().rpartition(b")")[2].split()[0].decode()
        except (OSError, IndexError, UnicodeDecodeError):
            return "?"

    @staticmethod
    def _native_cpu_s() -> float:
        """CPU seconds of the process's threads that Python does not run (torch's intra-op pool,
        the communication library's threads): the process's less each Python thread's."""
        total = time.process_time()
        for t in threading.enumerate():
            try:
                total -= time.clock_gettime(time.pthread_getcpuclockid(t.ident))  # type: ignore[arg-type]  # None: the TypeError below
            except (OSError, AttributeError, TypeError, OverflowError):
                continue
        return total

    def _main_position(self) -> tuple[int, int, bool, bool, bool]:
        """(code object id, bytecode offset, waiting in communication code, innermost frame in torch,
        waiting for torch's compiler)."""
        frame = sys._current_frames().get(self._main) if self._main is not None else None
        if frame is None:
            return (0, 0, True, False, False)
        in_torch = frame.f_code.co_filename.startswith(_TORCH_DIR)
        waiting = compiling = False
        f: Any = frame
        while f is not None:
            name = f.f_code.co_filename
            if name.startswith(self.modules):
                waiting = True
                break
            compiling = compiling or name.startswith(_COMPILE_WAITS)
            f = f.f_back
        return (id(frame.f_code), frame.f_lasti, waiting, in_torch, compiling)

    def _run(self) -> None:
        me = self.session.rank
        last_pos = self._main_position()
        last_cpu = self._main_cpu_s()
        last_native = self._native_cpu_s()
        progress = self.device_progress
        fences = 0  # the device's fences completed at the last look
        watched: tuple[int, ...] = ()
        seen: list[int] | None = None
        still: list[int] = []
        beat, quiet, last_bytes, hung_in = 0, 0, None, -1
        published: int | None = None  # the pause word this rank last published
        # the quiet word's (looks quiet, generation found hung) as last published: a word with no
        # quiet look is published once, not at every look (read by a peer, stale or not, it keeps
        # the alarm off: all_quiet needs every word fresh and quiet)
        said_quiet: tuple[int, int] | None = None
        last_beats: dict[int, int] = {}
        while not self._stop.wait(self.interval_s):
            try:
                self.last_look_wall = time.time()
                s = self.session
                if self._recovering is not None:  # this rank's own recovery runs: it beats, and judges nothing
                    self.channel.add(beat_key(s.rank), 1 + PROGRESS)  # (no step is watched, here or at a peer)
                    seen, quiet, last_bytes = None, 0, None  # judged afresh from the next step's looks
                    continue
                generation = s.generation
                ranks = s.members  # the original ranks still in the job (fewer after an excision)
                peers = watched_peers(me, ranks)
                keys = [beat_key(r) for r in peers]
                pos = self._main_position()
                cpu = self._main_cpu_s()
                native = self._native_cpu_s()
                on_device, fences = device_moved(progress, fences)
                look = Look(
                    self.watching,
                    pos[2],
                    pos[:2] != last_pos[:2],
                    cpu - last_cpu,
                    self._main_state(),
                    native - last_native,
                    pos[3],
                    pos[4],
                    on_device,
                )
                moving = progressed(look)
                self.channel.add(beat_key(me), 1 + (PROGRESS if moving else 0))
                last_pos, last_cpu, last_native = pos, cpu, native
                if look.watching:
                    self._pause = 0 if moving else self._pause + 1
                    self._step_pause = max(self._step_pause, self._pause)
                if self._forget_word:  # warm_up_again: no bound applies to this rank until it publishes anew
                    self._forget_word = False
                    self.channel.set(pause_key(me), None)
                    published = None
                word = self.pause_word()
                if word is not None and word != published:
                    self.channel.set(pause_key(me), str(word))
                    published = word
                if self.quiet_rule:
                    moved = self._data_bytes(generation) if self.watching and pos[2] else None
                    still_quiet = moved is not None and moved == last_bytes and not self._others_working()
                    quiet, last_bytes, beat = (quiet + 1 if still_quiet else 0), moved, beat + 1
                    if quiet or (quiet, hung_in) != said_quiet:  # a word saying "not quiet" holds until it changes
                        self.channel.set(quiet_key(me), QuietWord(beat, quiet, hung_in).encode())
                        said_quiet = (quiet, hung_in)
                counts = self.channel.counters(keys)  # one round trip for the peers this rank watches
                if not self.watching or seen is None or peers != watched:
                    still, seen, watched, last_beats = [0] * len(peers), counts, peers, {}
                    continue
                still = [watch(seen[i], counts[i], still[i]) for i in range(len(peers))]
                stalled = self._stalled(peers, still)
                seen = counts
                hung, heard = False, ""
                if self.quiet_rule and quiet > 0:  # this rank is quiet: are all? (read from the first quiet look)
                    judge = quiet_judge(ranks)
                    asked = ranks if me == judge else (judge,)  # the judge reads every word; the others its own
                    said = self.channel.peek([quiet_key(r) for r in asked])
                    words = {r: QuietWord.decode(v) if isinstance(v, str) else None for r, v in zip(asked, said)}
                    told = any(w is not None and w.hung == generation for w in words.values())  # a peer found it
                    hung = not stalled and (told or (me == judge and all_quiet(words, last_beats, self.misses)))
                    heard = (
                        "quiet words (rank: looks quiet, beat, generation found hung): "
                        + ", ".join(
                            f"{r}: {w.quiet} {w.beat} {w.hung}" if w else f"{r}: none" for r, w in words.items()
                        )
                        + (f"; a peer found generation {generation} hung" if told else "")
                    )
                    last_beats = {r: w.beat for r, w in words.items() if w is not None}
                else:
                    last_beats = {}
                # the step may have failed meanwhile and new groups be in the making: sever only
                # the generation this look was made in, while the step still runs
                if (stalled or hung) and not self._alarmed(generation) and self.watching and s.generation == generation:
                    self._raise(
                        HeartbeatAlarm(time.time(), tuple(stalled), hung, self._stall_detail if stalled else heard),
                        generation,
                    )
                    if hung and hung_in != generation:  # the ranks that read only the judge's word learn it now
                        self.channel.set(quiet_key(me), QuietWord(beat, 0, generation).encode())
                        said_quiet = (0, generation)
                    hung_in = generation if hung else hung_in
                    still, quiet = [0] * len(peers), 0
            except Exception as exc:  # noqa: BLE001  (a look that failed, e.g. a control-channel
                # round trip past its timeout under load, must not end the thread: the next look runs)
                self.failed_looks += 1
                self.last_failure = f"{type(exc).__name__}: {str(exc)[:200]}"
                seen = None
