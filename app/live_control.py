"""Live control for the dashboard: start, watch, fault and stop a local gloo recovery run.

A :class:`LiveJob` runs :mod:`meshpact.app.live_job` (one recovery trial of the live
runtime on N local gloo ranks, everything on 127.0.0.1) in its own process group. Every
process the trial starts inherits a job token in its environment, which is how the
dashboard finds the rank processes without any channel into the job (a fresh interpreter's
environment names its ``RANK``, the phase in ``MESHPACT_RUN_ID`` and the
``MESHPACT_INCARNATION``; a rank forked warm from the trial's fork server is named in the
launcher's list of the processes it started, ``processes.jsonl``): faults from the page
are real signals to a real rank process (``SIGKILL`` kills it; ``SIGSTOP`` then
``SIGCONT`` stalls it). :meth:`LiveJob.stop` ends the runner and every process carrying
the token; so does the job's watcher once the browser session that started it is gone,
the runner itself once the dashboard's process is gone (its lease), and a finalizer when
the job object is dropped. :func:`tail_events` reads the recording as it grows, a complete
line at a time; :class:`JobEvents` follows a job's rank logs and its parent's own events,
each event once, and :func:`rank_rows` turns them into the rank table (with
:func:`committed_step` and :func:`down_ranks` for the figures above and beside it);
:func:`failure_sentence` turns what a failed run left behind (an error message, a
traceback, a log) into one plain sentence for the page.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import weakref
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Callable, Sequence

from meshpact.app.format import clock
from meshpact.app.live_job import INJECTED_FILE, LEASE_ENV, TRIAL_DIR
from meshpact.core.errors import RecordingError
from meshpact.core.recording import Event, EventKind, partial_path
from meshpact.core.recovery import Policy
from meshpact.live.launch.launcher import LaunchedProcess  # torch-free
from meshpact.live.trials.trialconfig import PHASES, PROCESSES_FILE, Pace  # torch-free

__all__ = [
    "RankProcess",
    "RankRow",
    "rank_rows",
    "LiveJob",
    "tail_events",
    "job_processes",
    "failure_sentence",
    "TOKEN_ENV",
    "LEASE_ENV",
    "RankLogs",
    "RankEvent",
    "FaultFromPage",
    "JobEvent",
    "JobEvents",
    "job_stream",
    "committed_step",
    "down_ranks",
    "excised_ranks",
    "PARENT_EVENTS",
    "SentFault",
    "sent_caption",
    "form_problem",
    "stream_rows",
    "RUN_LINK",
    "RUN_NAME",
    "claim_recording",
    "earlier_run_notice",
    "planned_fault_kind",
]

TOKEN_ENV = "MESHPACT_DASHBOARD_JOB"


@dataclass(frozen=True)
class RankProcess:
    pid: int
    rank: int
    phase: str  # reference | faulted | cold (the trial's run id)
    incarnation: int
    stalled: bool  # SIGSTOPped (a stall sent from the page, in progress)


class FaultFromPage(str, Enum):
    """What the page can do to one rank of the faulted run."""

    KILL = "kill"  # SIGKILL: the rank is lost (the trial starts a replacement)
    STALL = "stall"  # SIGSTOP, then SIGCONT: the rank hangs past the data-path timeout
    PARTITION = "partition"  # the rank's host's data link goes down for a while (network namespaces only)


@dataclass(frozen=True)
class SentFault:
    """A fault sent from the page: what, to which rank, and when (wall time, read before the signal)."""

    kind: FaultFromPage
    rank: int
    t_wall: float


def sent_caption(sent: Sequence[SentFault], wall0: float) -> str:
    """The page's line of the faults it sent, each at its time on the event stream's clock (``wall0``:
    the recording's start, wall time, the zero of every other time on the page)."""
    return "Sent from this page: " + "; ".join(
        f"{f.kind.value} rank {f.rank} at {clock(f.t_wall - wall0)}" for f in sent
    )


@dataclass(frozen=True)
class RankEvent:
    """An event of one rank process's own log: the run it belongs to and the incarnation
    (0: first process of the rank, 1: its first replacement...). ``event.t`` is wall time."""

    phase: str
    incarnation: int
    event: Event


@dataclass(frozen=True)
class RankRow:
    """One row of the Live page's rank table: a rank's newest process in a run and what its
    own event log last said."""

    rank: int
    pid: int | None  # None: no live process (killed, not yet replaced, or finished)
    incarnation: int
    phase: str
    state: str  # starting | held | training | recovering: <stage> | stalled | dead | excised | done | stopped
    step: int | None  # committed step
    generation: int | None  # the generation its last step (or hold) ran in
    collective: str  # the world group of the last committed step and its sequence number
    last_event: str
    silent_s: float | None  # seconds since the rank's last event

    @property
    def can_fault(self) -> bool:
        """A live process of the faulted run past its start (a fault earlier would hit a rank
        still saving its first checkpoint)."""
        return self.pid is not None and self.phase == "faulted" and self.state in ("held", "training")


# the events that say which generation a rank trains (or waits, held) in; a recovery's own events name the
# generation it builds, and the in-job checkpoint baseline's drill after the last step builds one nobody trains in
_TRAINS_IN = frozenset({EventKind.STEP, EventKind.HELD})
_DONE = frozenset({EventKind.RECOVERY_DONE, EventKind.FIRST_COLLECTIVE, EventKind.STEP, EventKind.CHECKPOINT})
# what the trial's parent writes into the recording itself; every other event of a recording is a copy of a rank
# process's own log, made when the run ends
PARENT_EVENTS = frozenset(
    {
        EventKind.RECORDING_START,
        EventKind.REPLACEMENT_STARTED,
        EventKind.FAULT_INJECTED,
        EventKind.RECOVERED,
        EventKind.TRAINED,
        EventKind.SUMMARY,
    }
)
# ranks whose step is not the job's: excised, lost and not (yet) replaced, or never seen in this run
OUT_OF_JOB = frozenset({"excised", "dead", "—"})
DOWN = frozenset({"excised", "dead", "stalled"})  # what the mesh marks failed: a recovering survivor is not, nor a
# rank the page's Stop ended


def excised_ranks(events: Sequence[RankEvent], phase: str) -> set[int]:
    """The ranks the survivors of ``phase`` decided to go on without: every excision a rank's
    ``decided`` event names (the trial's own judgement reads the same events the same way)."""
    return {
        int(r)
        for re in events
        if re.phase == phase
        and re.event.event == EventKind.DECIDED
        and re.event.data.get("policy") == Policy.EXCISE.value
        for r in re.event.data.get("lost", ())
    }


def rank_rows(
    procs: Sequence[RankProcess],
    events: Sequence[RankEvent],
    phase: str,
    now: float,
    world_size: int,
    steps: int | None = None,
    finished: bool = False,
    stopped: bool = False,
) -> list[RankRow]:
    """A row per rank of the ``phase`` run: its newest process (or none, when it is gone) and
    its newest incarnation's events (``now``: wall time, for the silence).

    A rank with no process is *excised* when the survivors decided to go on without it, *done*
    when its newest incarnation committed the run's last step (``steps``) or the whole run
    ended well (``finished``), *stopped* when the run was stopped from the page (``stopped``:
    its process was ended, not lost; its row keeps its last committed step), and otherwise
    *dead*: lost, its replacement not (yet) running."""
    newest: dict[int, RankProcess] = {}
    for p in procs:
        if p.phase == phase and (p.rank not in newest or p.incarnation >= newest[p.rank].incarnation):
            newest[p.rank] = p
    mine: dict[int, list[RankEvent]] = {}
    for re in events:
        if re.phase == phase and re.event.rank is not None:
            mine.setdefault(re.event.rank, []).append(re)
    excised = excised_ranks(events, phase)
    out = []
    for rank in range(world_size):
        proc = newest.get(rank)
        evs = mine.get(rank, [])
        inc = max([e.incarnation for e in evs] + ([proc.incarnation] if proc else [0]))
        own = sorted((e.event for e in evs if e.incarnation == inc), key=lambda e: e.t)
        step = generation = None
        collective, state, last_step = "", "starting", False
        for e in own:
            if e.event in (EventKind.STEP, EventKind.CHECKPOINT, EventKind.HELD) and "step" in e.data:
                step = int(e.data["step"])
                last_step = last_step or (e.event == EventKind.STEP and steps is not None and step >= steps)
            if e.event in _TRAINS_IN and isinstance(e.data.get("generation"), int):
                generation = int(e.data["generation"])
            if e.event == EventKind.STEP:
                collective = f"{e.data.get('group', '?')} #{e.data.get('seq', '?')}"
            if e.event == EventKind.HELD:
                state = "held"
            elif e.stage is not None:
                state = f"recovering: {e.stage.value}"
            elif e.event in _DONE:
                state = "training"
        last = own[-1] if own else None
        if proc is None:
            if rank in excised:
                state = "excised"
            elif own and (last_step or finished):
                state = "done"
            elif stopped:
                state = "stopped"
            else:
                state = "dead" if own else "—"
        elif proc.stalled:
            state = "stalled"
        out.append(
            RankRow(
                rank,
                proc.pid if proc else None,
                proc.incarnation if proc else inc,
                phase,
                state,
                step,
                generation,
                collective,
                str(last.event) if last else "",
                max(now - last.t, 0.0) if last else None,
            )
        )
    return out


def committed_step(rows: Sequence[RankRow]) -> int | None:
    """The job's committed step: the least step committed by the ranks still in the job (an
    excised rank's, or a dead one's, last step is not the job's)."""
    steps = [r.step for r in rows if r.step is not None and r.state not in OUT_OF_JOB]
    return min(steps) if steps else None


def down_ranks(rows: Sequence[RankRow]) -> list[int]:
    """The ranks the mesh draws as failed: dead, excised or stalled; never a survivor that is
    recovering, a rank that finished, nor one the page's Stop ended."""
    return [r.rank for r in rows if r.state in DOWN]


class RankLogs:
    """Follows every rank process's event log under a trial's work directory
    (``<run>/events-rank<r>-<incarnation>.jsonl``), a complete line at a time."""

    def __init__(self, trial_dir: Path) -> None:
        self.trial_dir = Path(trial_dir)
        self._offsets: dict[Path, int] = {}

    def poll(self) -> list[RankEvent]:
        """The events written since the last poll, in each file's order."""
        out: list[RankEvent] = []
        for phase in PHASES:
            for path in sorted((self.trial_dir / phase).glob("events-rank*-*.jsonl")):
                try:
                    inc = int(path.stem.rsplit("-", 1)[1])
                except ValueError:
                    continue
                new, self._offsets[path] = _read_lines(path, self._offsets.get(path, 0))
                out.extend(RankEvent(phase, inc, e) for e in new)
        return out


@dataclass(frozen=True)
class JobEvent:
    """One event of a dashboard job's stream: ``run`` is the trial's run it belongs to (for the
    parent's own events, the run going on when it was written; "" before any); ``event.t`` is
    seconds since the recording began."""

    run: str
    event: Event


class JobEvents:
    """A job's events as they are written, each once: every rank process's own log (all runs,
    :class:`RankLogs`) and the trial parent's own events from the recording
    (:data:`PARENT_EVENTS`); the recording's copies of the rank logs, written when the run ends,
    are left out, so a count never drops when the run ends. Without ``trial_dir`` (a job that
    keeps no rank logs) the recording is the whole stream.

    :attr:`rank_events` and :attr:`parent_events` hold everything read so far. The finished
    recording (written whole, then perhaps rewritten with the faults sent from the page) is
    read whole each time it changes and replaces what the growing one gave."""

    def __init__(self, recording: Path, trial_dir: Path | None = None) -> None:
        self.recording = Path(recording)
        self.rank_logs = RankLogs(trial_dir) if trial_dir is not None else None
        self.wall0: float | None = None  # the recording's start, wall time
        self.rank_events: list[RankEvent] = []  # t: wall time
        self.parent_events: list[Event] = []  # t: seconds since the recording began
        self._offset = 0
        self._finished: tuple[int, int, int] | None = None  # the finished recording's inode, size, mtime

    def _mine(self, events: list[Event]) -> list[Event]:
        return events if self.rank_logs is None else [e for e in events if e.event in PARENT_EVENTS]

    def poll(self) -> tuple[list[RankEvent], list[Event]]:
        """The events written since the last poll: rank events (``t`` wall time) and the parent's
        own (``t`` since the recording began)."""
        rank_new = self.rank_logs.poll() if self.rank_logs is not None else []
        self.rank_events.extend(rank_new)
        if partial_path(self.recording).exists() or not self.recording.exists():
            new, self._offset = tail_events(self.recording, self._offset)
            new = self._mine(new)
            self.parent_events.extend(new)
        else:
            new = self._reread()
        first = self.parent_events[0] if self.parent_events else None
        if self.wall0 is None and first is not None and isinstance(first.data.get("wall_time"), (int, float)):
            self.wall0 = float(first.data["wall_time"]) - first.t
        return rank_new, new

    def _reread(self) -> list[Event]:
        """The finished recording, read whole when it changed: it replaces the parent events read
        so far; returns those not read before (the same time, kind, rank and stage)."""
        try:
            st = self.recording.stat()
        except OSError:
            return []
        sig = (st.st_ino, st.st_size, st.st_mtime_ns)
        if sig == self._finished:
            return []
        whole, _ = _read_lines(self.recording, 0)
        whole = self._mine(whole)
        self._finished = sig
        seen: dict[tuple[object, ...], int] = {}
        for e in self.parent_events:
            seen[_key(e)] = seen.get(_key(e), 0) + 1
        new = []
        for e in whole:
            if seen.get(_key(e), 0):
                seen[_key(e)] -= 1
            else:
                new.append(e)
        self.parent_events = whole
        return new


def _key(e: Event) -> tuple[object, ...]:
    return round(e.t, 6), str(e.event), e.rank, e.stage


def job_stream(rank_events: Sequence[RankEvent], parent_events: Sequence[Event], wall0: float) -> list[JobEvent]:
    """One time-ordered stream of a job's events (``wall0``: the recording's start, wall time):
    each rank event under its run, each parent event under the run of the rank event before it."""
    ranked = [
        JobEvent(e.phase, Event(e.event.t - wall0, e.event.event, e.event.rank, e.event.stage, e.event.data))
        for e in rank_events
    ]
    merged = sorted(
        [(e.event.t, 0, e) for e in ranked] + [(e.t, 1, JobEvent("", e)) for e in parent_events],
        key=lambda x: (x[0], x[1]),
    )
    out, run = [], ""
    for _, _, je in merged:
        if je.run:
            run = je.run
            out.append(je)
        else:
            out.append(JobEvent(str(je.event.data.get("phase") or run), je.event))
    return out


def stream_rows(stream: Sequence[JobEvent]) -> list[dict[str, str]]:
    """The page's event table: a row per event, every cell filled (the trial's own events before
    any run began, such as ``recording_start``, under the run "trial")."""
    return [
        {
            "time": clock(e.event.t),
            "run": e.run or "trial",
            "event": str(e.event.event),
            "rank": "" if e.event.rank is None else str(e.event.rank),
            "stage": e.event.stage.value if e.event.stage else "",
            "step": str(e.event.data.get("step", "")),
        }
        for e in stream
    ]


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    out = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            out[key.decode(errors="replace")] = value.decode(errors="replace")
    return out


def _state(pid: int) -> str:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "?"
    return stat.rsplit(")", 1)[-1].split()[0]


def job_processes(token: str) -> list[tuple[int, dict[str, str]]]:
    """Live processes (not zombies) whose environment carries ``token``."""
    out = []
    me = os.getpid()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        env = _environ(int(entry.name))
        if env.get(TOKEN_ENV) == token and _state(int(entry.name)) not in ("Z", "X", "?"):
            out.append((int(entry.name), env))
    return out


def _signal(pid: int, sig: int) -> bool:
    try:
        os.kill(pid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def _end(proc: subprocess.Popen, token: str) -> None:
    """Stop the runner's process group (its lease let go first: a runner that watches it ends
    its ranks itself), wait for it (no zombie), then kill anything still carrying the token."""
    if proc.stdin is not None and not proc.stdin.closed:
        with contextlib.suppress(OSError):
            proc.stdin.close()
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait(timeout=5)
    _sweep(token)


def _sweep(token: str, wait_s: float = 5.0) -> None:
    """Kill every process still carrying ``token`` (a stopped one is woken to die), and wait up to
    ``wait_s`` for them to be gone: a killed process is listed until the kernel has taken it down,
    and whoever stopped the run reads its processes next."""
    deadline = time.monotonic() + wait_s
    while True:
        left = job_processes(token)
        if not left or time.monotonic() > deadline:
            return
        for pid, _ in left:
            _signal(pid, signal.SIGCONT)
            _signal(pid, signal.SIGKILL)
        time.sleep(0.02)


def _watch(
    proc: subprocess.Popen, token: str, alive: Callable[[], bool] | None, grace_s: float, every_s: float = 0.25
) -> None:
    """Until the runner exits: once ``alive()`` (the browser session that started the job is
    still connected) has said no for ``grace_s`` seconds, end the job. However the runner ends,
    it is reaped here and anything it left carrying the token is killed."""
    lost_since: float | None = None
    while proc.poll() is None:
        if alive is not None:
            try:
                ok = bool(alive())
            except Exception:  # noqa: BLE001 - a runtime being torn down: the session is over
                ok = False
            now = time.monotonic()
            lost_since = None if ok else (lost_since if lost_since is not None else now)
            if lost_since is not None and now - lost_since >= grace_s:
                _end(proc, token)
                return
        time.sleep(every_s)
    _sweep(token)


class LiveJob:
    """One recovery trial started from the dashboard."""

    def __init__(
        self,
        recording: Path,
        args: Sequence[str],
        cwd: Path | None = None,
        runner: Sequence[str] = ("-m", "meshpact.app.live_job"),
        world_size: int = 0,
        pace: Pace | None = None,
        steps: int | None = None,
        session_alive: Callable[[], bool] | None = None,
        grace_s: float = 2.0,
    ) -> None:
        """``pace`` given: the trial runs in this job's work directory (``--work-dir``), its
        ranks keep that pace and log every step, and :attr:`events` follows their logs beside the
        recording (without one, :attr:`events` follows the recording alone).

        The job ends with whoever started it: ``session_alive`` (the browser session still
        connected) saying no for ``grace_s`` seconds ends it, from a thread that also reaps the
        runner; and the runner holds a lease on this process (its stdin, see
        :data:`LEASE_ENV`), so it ends its ranks itself when this process goes, however it goes."""
        self.token = uuid.uuid4().hex
        self.args = tuple(args)  # the runner's arguments, as the page gave them
        self.world_size = world_size
        self.steps = steps
        self.recording = Path(recording)
        self.work = Path(tempfile.mkdtemp(prefix="meshpact-live-"))  # runner's log, result, trial; not the recordings
        self.result_path = self.work / "result.json"
        self.log_path = self.work / "runner.log"
        self.trial_dir = self.work / TRIAL_DIR
        self.recording.parent.mkdir(parents=True, exist_ok=True)
        self.started = time.time()
        self.pace = pace
        self.events = JobEvents(self.recording, self.trial_dir if pace is not None else None)
        extra: list[str] = []
        if pace is not None:
            self.trial_dir.mkdir()
            pace.write(self.trial_dir)
            extra = ["--work-dir", str(self.work)]
        env = {**os.environ, TOKEN_ENV: self.token, LEASE_ENV: "stdin", "OMP_NUM_THREADS": "1"}
        cmd = [
            sys.executable,
            *runner,
            "--record",
            str(self.recording),
            "--result",
            str(self.result_path),
            *args,
            *extra,
        ]
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            cmd,
            cwd=cwd,
            env=env,
            stdin=subprocess.PIPE,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self._finalizer = weakref.finalize(self, _end, self.proc, self.token)
        self.watcher = threading.Thread(
            target=_watch,
            args=(self.proc, self.token, session_alive, grace_s),
            name=f"meshpact-live-job-{self.token[:8]}",
            daemon=True,
        )
        self.watcher.start()
        weakref.finalize(self, shutil.rmtree, self.work, True)
        self.injected: list[SentFault] = []
        self.stopped = False  # True once stop() was called: the run's end was asked for, not a failure
        self.phases_seen: set[str] = set()  # the runs whose rank processes ranks() has found, gone ones included

    @property
    def status(self) -> str:
        """What the page says of the run: running, stopped (by stop()) or ended (<exit status>)."""
        if self.running:
            return "running"
        return "stopped" if self.stopped else f"ended ({self.returncode})"

    @property
    def running(self) -> bool:
        return self.proc.poll() is None

    @property
    def returncode(self) -> int | None:
        return self.proc.poll()

    def ranks(self) -> list[RankProcess]:
        """The job's live rank processes: a fresh interpreter says who it is in its environment; a
        rank forked from the trial's fork server shows the server's (the token, no ``RANK``), and
        the launcher's list (:data:`PROCESSES_FILE`) says who it is. Only a process carrying the
        token counts, so a pid reused by another process is never taken for a rank."""
        launched = {p.pid: p for p in LaunchedProcess.read(self.trial_dir / PROCESSES_FILE) if p.rank is not None}
        out = []
        for pid, env in job_processes(self.token):
            if pid == self.proc.pid:
                continue
            if "RANK" in env:
                out.append(
                    RankProcess(
                        pid,
                        int(env["RANK"]),
                        env.get("MESHPACT_RUN_ID", "?"),
                        int(env.get("MESHPACT_INCARNATION", "0") or 0),
                        _state(pid) == "T",
                    )
                )
            elif pid in launched:
                p = launched[pid]
                out.append(RankProcess(pid, int(p.rank or 0), p.run_id or "?", p.incarnation, _state(pid) == "T"))
        self.phases_seen.update(r.phase for r in out)
        return sorted(out, key=lambda r: (r.phase, r.rank, r.incarnation))

    def _rank(self, rank: int, phase: str | None) -> RankProcess:
        live = [r for r in self.ranks() if r.rank == rank and (phase is None or r.phase == phase)]
        if not live:
            where = f" in the {phase} run" if phase else ""
            raise LookupError(f"rank {rank} has no running process{where} right now")
        return live[-1]

    def set_pace(self, pace: Pace) -> None:
        """Steer the ranks from their next step on (only for a job started with a pace)."""
        if self.pace is None:
            raise LookupError("this run was started without a pace control")
        pace.write(self.trial_dir)
        self.pace = pace

    def _note(self, kind: FaultFromPage, target: RankProcess, now: float, **extra: Any) -> None:
        """Keep the fault sent at wall time ``now`` for the page and for the recording (the runner
        adds it at the end). ``now`` is read before the signal goes: a rank may know of the fault
        before the call that sent it returns, and its recovery is the one detected after it."""
        record = {
            "kind": kind.value,
            "rank": target.rank,
            "pid": target.pid,
            "phase": target.phase,
            "incarnation": target.incarnation,
            **extra,
        }
        self.injected.append(SentFault(kind, target.rank, now))
        with open(self.work / INJECTED_FILE, "a") as fh:
            fh.write(json.dumps({"t_wall": now, **record}) + "\n")

    def kill_rank(self, rank: int, phase: str | None = "faulted") -> RankProcess:
        """SIGKILL the rank's process: the fault the runtime meets as a lost rank."""
        target = self._rank(rank, phase)
        now = time.time()
        if _signal(target.pid, signal.SIGKILL):
            self._note(FaultFromPage.KILL, target, now)
        return target

    def stall_rank(self, rank: int, seconds: float, phase: str | None = "faulted") -> RankProcess:
        """SIGSTOP the rank's process for ``seconds``, then SIGCONT: a stall past the timeout."""
        target = self._rank(rank, phase)
        now = time.time()
        if _signal(target.pid, signal.SIGSTOP):
            timer = threading.Timer(seconds, _signal, args=(target.pid, signal.SIGCONT))
            timer.daemon = True
            timer.start()
            self._note(FaultFromPage.STALL, target, now, seconds=seconds)
        return target

    def partition_why_not(self, rank: int, phase: str = "faulted", pid: int | None = None) -> str | None:
        """Why the rank (its process ``pid``, when known) cannot be partitioned from here, or None
        when it can: the ranks must run in network namespaces (planned fault kind partition)."""
        if pid is None:
            try:
                pid = self._rank(rank, phase).pid
            except LookupError as exc:
                return str(exc)
        if not _environ(pid).get("MESHPACT_DATA_IFACE"):
            return "partition needs the ranks in network namespaces: start the run with planned fault kind partition"
        if shutil.which("ip") is None:
            return "partition needs ip (iproute2)"
        return None

    def partition_rank(self, rank: int, seconds: float, phase: str = "faulted") -> RankProcess:
        """Take the data link of the rank's host (its network namespace) down for ``seconds``:
        every rank on that side loses its peers on the other side."""
        why = self.partition_why_not(rank, phase)
        if why:
            raise LookupError(why)
        target = self._rank(rank, phase)
        iface = _environ(target.pid)["MESHPACT_DATA_IFACE"]
        ns = subprocess.run(
            ["ip", "netns", "identify", str(target.pid)], capture_output=True, text=True, timeout=5
        ).stdout.strip()
        if not ns:
            raise LookupError(f"rank {rank}'s network namespace has no name (ip netns identify found none)")
        now = time.time()
        subprocess.run(
            ["ip", "-n", ns, "link", "set", "dev", iface, "down"], check=True, timeout=5, capture_output=True
        )
        subprocess.Popen(
            ["sh", "-c", 'sleep "$0"; ip -n "$1" link set dev "$2" up', f"{seconds:.3f}", ns, iface],
            start_new_session=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self._note(FaultFromPage.PARTITION, target, now, seconds=seconds, iface=iface)
        return target

    def stop(self) -> None:
        """End the run and every process it started; the run then reads as stopped, not failed."""
        self.stopped = True
        self._finalizer()
        if not self._log.closed:
            self._log.close()

    def result(self) -> dict[str, Any] | None:
        try:
            return json.loads(self.result_path.read_text())
        except (OSError, ValueError):
            return None

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


def _read_lines(src: Path, offset: int) -> tuple[list[Event], int]:
    """Events of the complete lines of ``src`` after byte ``offset``, and the new offset."""
    try:
        with open(src, "rb") as fh:
            fh.seek(offset)
            chunk = fh.read()
    except OSError:
        return [], offset
    end = chunk.rfind(b"\n")
    if end < 0:
        return [], offset
    events = []
    for n, line in enumerate(chunk[: end + 1].splitlines()):
        if line.strip():
            try:
                events.append(Event.from_dict(json.loads(line), where=f"{src}: event {n}"))
            except (ValueError, RecordingError):  # a malformed line is skipped, not fatal to the panel
                continue
    return events, offset + end + 1


def tail_events(path: Path, offset: int = 0) -> tuple[list[Event], int]:
    """Events appended to the recording since byte ``offset``: read from ``<path>.partial``
    while it is written, else from the finished file. A line not yet ended is left for
    the next call. Returns the events and the new offset."""
    src = partial_path(path)
    if not src.exists():
        src = Path(path)
    return _read_lines(src, offset)


def failure_sentence(text: str) -> str:
    """One plain sentence saying why a run failed, from an error message, a traceback or a
    log: the last ``Type: reason`` line of the text (the exception that ended it), as
    ``reason (Type).``; else the last non-empty line; else a sentence saying no reason was left."""
    lines = [ln.strip() for ln in (text or "").splitlines() if ln.strip()]
    for line in reversed(lines):
        head, sep, reason = line.partition(": ")
        name = head.rsplit(".", 1)[-1]
        if (
            sep
            and name.isidentifier()
            and (
                name.endswith(("Error", "Exception", "Fault", "Interrupt"))
                or name in ("SystemExit", "KeyboardInterrupt")
            )
        ):
            reason = reason.strip().rstrip(".")
            return f"{reason[:1].upper()}{reason[1:]} ({name})." if reason else f"The run raised {name}."
    if lines:
        last = lines[-1][:300].rstrip(".")
        return f"{last[:1].upper()}{last[1:]}."
    return "The run ended without saying why (no error message and an empty log)."


def form_problem(ranks: int, faults: int, fault_kind: str, on_rank_loss: str) -> str | None:
    """What is wrong with the Live page's start form, in the page's own words (its field names,
    not the CLI's flags), or None when the trial can start. The planned fault kind matters only
    with planned faults: an excising run with none starts whatever kind the box shows."""
    if on_rank_loss == "excise":
        if faults > 0 and fault_kind != "kill":
            return (
                f"**on rank loss: excise** goes on without a killed rank, so with **planned faults** the **planned "
                f"fault kind** must be **kill**, not **{fault_kind}** (or set **planned faults** to 0 and kill "
                "ranks from their rows)."
            )
        if faults > ranks - 1:
            return (
                f"**on rank loss: excise** removes a different rank per fault: at most {ranks - 1} **planned "
                f"faults** with {ranks} **ranks**, not {faults}."
            )
    return None


def planned_fault_kind(faults: int, fault_kind: str, on_rank_loss: str) -> str:
    """The fault kind the run is started with: the form's, except an excising run with no planned
    faults, whose only faults are the page's kills (the form's kind plays no part in it)."""
    return "kill" if on_rank_loss == "excise" and faults == 0 else fault_kind


RUN_LINK = "run"  # the Live page's query parameter: the recording (its name) of the run this tab started
RUN_NAME = r"live-[0-9]{8}-[0-9]{6}(?:-[0-9]{1,4})?"  # a Live page run's recording: its start second, then a count


def claim_recording(folder: Path, now: float | None = None) -> Path:
    """A new Live page run's recording under ``folder``, named by the second it starts in and
    claimed there at once (its partial file made exclusively): two tabs, or two servers in one
    folder, starting runs in the same second get ``live-<second>`` and ``live-<second>-2``, never
    one file for both."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    folder.mkdir(parents=True, exist_ok=True)
    for n in range(1, 10_000):
        path = folder / (f"live-{stamp}.jsonl" if n == 1 else f"live-{stamp}-{n}.jsonl")
        if path.exists():
            continue
        try:
            os.close(os.open(partial_path(path), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
        except FileExistsError:
            continue
        return path
    raise RecordingError(f"no free recording name for the second {stamp} in {folder}: 9,999 runs began in it")


def earlier_run_notice(name: str | None, folder: Path) -> str | None:
    """What became of the run a reloaded (or reopened) Live page had started, named in its link
    (``name``: the recording's stem under ``folder``): a run lasts as long as the browser session
    that started it, so a reload stops it. None for no name, or one that is no run of this page's."""
    import re

    if not name or not re.fullmatch(RUN_NAME, name):
        return None
    final, partial = folder / f"{name}.jsonl", partial_path(folder / f"{name}.jsonl")
    try:
        finished = final.is_file() and '"summary"' in final.read_text(errors="replace")[-200_000:]
    except OSError:
        finished = False
    if finished:
        return f"The run **{name}** that this tab started has finished; its recording is `{final}`."
    kept = final if final.is_file() else partial if partial.is_file() else None
    where = f" What it recorded is in `{kept}`." if kept else " It had recorded nothing yet."
    return (
        f"The run **{name}** that this tab started was stopped when the page was reloaded or its tab closed: a "
        f"run lasts as long as the browser session that started it.{where}"
    )
