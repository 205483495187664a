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
the token; a finalizer does the same when the job object is dropped with the session.
:func:`tail_events` reads the recording as it grows, a complete line at a time;
:func:`failure_sentence` turns what a failed run left behind (an error message, a
traceback, a log) into one plain sentence for the page.
"""

from __future__ import annotations

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
from typing import Any, Sequence

from meshpact.app.live_job import INJECTED_FILE, TRIAL_DIR
from meshpact.core.errors import RecordingError
from meshpact.core.recording import Event, EventKind, partial_path
from meshpact.core.recovery import Policy
from meshpact.live.launcher import LaunchedProcess  # torch-free
from meshpact.live.trials.trialconfig import PHASES, PROCESSES_FILE, Pace  # torch-free

__all__ = ["RankProcess", "RankRow", "rank_rows", "LiveJob", "tail_events", "job_processes", "failure_sentence",
           "TOKEN_ENV", "RankLogs", "RankEvent", "FaultFromPage"]

TOKEN_ENV = "MESHPACT_DASHBOARD_JOB"


@dataclass(frozen=True)
class RankProcess:
    pid: int
    rank: int
    phase: str  # reference | faulted | cold (the trial's run id)
    incarnation: int
    stopped: bool  # SIGSTOPped (a stall in progress)


class FaultFromPage(str, Enum):
    """What the page can do to one rank of the faulted run."""

    KILL = "kill"  # SIGKILL: the rank is lost (the trial starts a replacement)
    STALL = "stall"  # SIGSTOP, then SIGCONT: the rank hangs past the data-path timeout
    PARTITION = "partition"  # the rank's host's data link goes down for a while (network namespaces only)


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
    state: str  # starting | held | training | recovering: <stage> | stopped | gone | excised | done
    step: int | None  # committed step
    generation: int | None
    collective: str  # the world group of the last committed step and its sequence number
    last_event: str
    silent_s: float | None  # seconds since the rank's last event

    @property
    def can_fault(self) -> bool:
        """A live process of the faulted run past its start (a fault earlier would hit a rank
        still saving its first checkpoint)."""
        return self.pid is not None and self.phase == "faulted" and self.state in ("held", "training")


_DONE = frozenset({EventKind.RECOVERY_DONE, EventKind.FIRST_COLLECTIVE, EventKind.STEP, EventKind.CHECKPOINT})


def rank_rows(procs: Sequence[RankProcess], events: Sequence[RankEvent], phase: str, now: float,
              world_size: int) -> list[RankRow]:
    """A row per rank of the ``phase`` run: its newest process (or none, when it is gone) and
    its newest incarnation's events (``now``: wall time, for the silence)."""
    newest: dict[int, RankProcess] = {}
    for p in procs:
        if p.phase == phase and (p.rank not in newest or p.incarnation >= newest[p.rank].incarnation):
            newest[p.rank] = p
    mine: dict[int, list[RankEvent]] = {}
    excised: set[int] = set()  # ranks the survivors decided to go on without
    for re in events:
        if re.phase == phase and re.event.rank is not None:
            mine.setdefault(re.event.rank, []).append(re)
            if re.event.event == EventKind.DECIDED and re.event.data.get("policy") == Policy.EXCISE.value:
                excised.update(int(r) for r in re.event.data.get("lost", ()))
    out = []
    for rank in range(world_size):
        proc = newest.get(rank)
        evs = mine.get(rank, [])
        inc = max([e.incarnation for e in evs] + ([proc.incarnation] if proc else [0]))
        evs = sorted((e.event for e in evs if e.incarnation == inc), key=lambda e: e.t)
        step = generation = None
        collective, state = "", "starting"
        for e in evs:
            if e.event in (EventKind.STEP, EventKind.CHECKPOINT, EventKind.HELD) and "step" in e.data:
                step = int(e.data["step"])
            if "generation" in e.data and isinstance(e.data["generation"], int):
                generation = int(e.data["generation"])
            if e.event == EventKind.STEP:
                collective = f"{e.data.get('group', '?')} #{e.data.get('seq', '?')}"
            if e.event == EventKind.HELD:
                state = "held"
            elif e.stage is not None:
                state = f"recovering: {e.stage.value}"
            elif e.event in _DONE:
                state = "training"
        last = evs[-1] if evs else None
        if proc is None:
            state = "excised" if rank in excised else ("gone" if evs else "—")
        elif proc.stopped:
            state = "stopped"
        out.append(RankRow(rank, proc.pid if proc else None, proc.incarnation if proc else inc, phase, state, step,
                           generation, collective, str(last.event) if last else "",
                           max(now - last.t, 0.0) if last else None))
    return out


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
    """Stop the runner's process group, then anything else still carrying the token."""
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
    for pid, _ in job_processes(token):
        _signal(pid, signal.SIGCONT)
        _signal(pid, signal.SIGKILL)


class LiveJob:
    """One recovery trial started from the dashboard."""

    def __init__(self, recording: Path, args: Sequence[str], cwd: Path | None = None,
                 runner: Sequence[str] = ("-m", "meshpact.app.live_job"), world_size: int = 0,
                 pace: Pace | None = None) -> None:
        """``pace`` given: the trial runs in this job's work directory (``--work-dir``), its
        ranks keep that pace and log every step, and :attr:`rank_logs` follows them."""
        self.token = uuid.uuid4().hex
        self.world_size = world_size
        self.recording = Path(recording)
        self.work = Path(tempfile.mkdtemp(prefix="meshpact-live-"))  # runner's log, result, trial; not the recordings
        self.result_path = self.work / "result.json"
        self.log_path = self.work / "runner.log"
        self.trial_dir = self.work / TRIAL_DIR
        self.recording.parent.mkdir(parents=True, exist_ok=True)
        self.started = time.time()
        self.pace = pace
        self.rank_logs = RankLogs(self.trial_dir)
        extra: list[str] = []
        if pace is not None:
            self.trial_dir.mkdir()
            pace.write(self.trial_dir)
            extra = ["--work-dir", str(self.work)]
        env = {**os.environ, TOKEN_ENV: self.token, "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, *runner, "--record", str(self.recording), "--result", str(self.result_path), *args,
               *extra]
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self._finalizer = weakref.finalize(self, _end, self.proc, self.token)
        weakref.finalize(self, shutil.rmtree, self.work, True)
        self.injected: list[dict[str, Any]] = []
        self.stopped = False  # True once stop() was called: the run's end was asked for, not a failure

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
                out.append(RankProcess(pid, int(env["RANK"]), env.get("MESHPACT_RUN_ID", "?"),
                                       int(env.get("MESHPACT_INCARNATION", "0") or 0), _state(pid) == "T"))
            elif pid in launched:
                p = launched[pid]
                out.append(RankProcess(pid, int(p.rank or 0), p.run_id or "?", p.incarnation, _state(pid) == "T"))
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

    def _note(self, kind: FaultFromPage, target: RankProcess, **extra: Any) -> None:
        """Keep the fault for the page and for the recording (the runner adds it at the end)."""
        now = time.time()
        record = {"kind": kind.value, "rank": target.rank, "pid": target.pid, "phase": target.phase,
                  "incarnation": target.incarnation, **extra}
        self.injected.append({"t": now - self.started, **record})
        with open(self.work / INJECTED_FILE, "a") as fh:
            fh.write(json.dumps({"t_wall": now, **record}) + "\n")

    def kill_rank(self, rank: int, phase: str | None = "faulted") -> RankProcess:
        """SIGKILL the rank's process: the fault the runtime meets as a lost rank."""
        target = self._rank(rank, phase)
        if _signal(target.pid, signal.SIGKILL):
            self._note(FaultFromPage.KILL, target)
        return target

    def stall_rank(self, rank: int, seconds: float, phase: str | None = "faulted") -> RankProcess:
        """SIGSTOP the rank's process for ``seconds``, then SIGCONT: a stall past the timeout."""
        target = self._rank(rank, phase)
        if _signal(target.pid, signal.SIGSTOP):
            timer = threading.Timer(seconds, _signal, args=(target.pid, signal.SIGCONT))
            timer.daemon = True
            timer.start()
            self._note(FaultFromPage.STALL, target, seconds=seconds)
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
        ns = subprocess.run(["ip", "netns", "identify", str(target.pid)], capture_output=True, text=True,
                            timeout=5).stdout.strip()
        if not ns:
            raise LookupError(f"rank {rank}'s network namespace has no name (ip netns identify found none)")
        subprocess.run(["ip", "-n", ns, "link", "set", "dev", iface, "down"], check=True, timeout=5,
                       capture_output=True)
        subprocess.Popen(["sh", "-c", 'sleep "$0"; ip -n "$1" link set dev "$2" up', f"{seconds:.3f}", ns, iface],
                         start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self._note(FaultFromPage.PARTITION, target, seconds=seconds, iface=iface)
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
        if sep and name.isidentifier() and (name.endswith(("Error", "Exception", "Fault", "Interrupt"))
                                            or name in ("SystemExit", "KeyboardInterrupt")):
            reason = reason.strip().rstrip(".")
            return f"{reason[:1].upper()}{reason[1:]} ({name})." if reason else f"The run raised {name}."
    if lines:
        last = lines[-1][:300].rstrip(".")
        return f"{last[:1].upper()}{last[1:]}."
    return "The run ended without saying why (no error message and an empty log)."


def form_problem(ranks: int, faults: int, fault_kind: str, on_rank_loss: str) -> str | None:
    """What is wrong with the Live page's start form, in the page's own words (its field names,
    not the CLI's flags), or None when the trial can start."""
    if on_rank_loss == "excise":
        if fault_kind != "kill":
            return (f"**on rank loss: excise** goes on without a killed rank, so the **planned fault kind** must be "
                    f"**kill**, not **{fault_kind}**.")
        if faults > ranks - 1:
            return (f"**on rank loss: excise** removes a different rank per fault: at most {ranks - 1} **planned "
                    f"faults** with {ranks} **ranks**, not {faults}.")
    return None
