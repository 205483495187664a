"""Live control for the dashboard: start, watch, fault and stop a local gloo recovery run.

A :class:`LiveJob` runs :mod:`meshpact.app.live_job` (one recovery trial of the live
runtime on N local gloo ranks, everything on 127.0.0.1) in its own process group. Every
process the trial starts inherits a job token in its environment, which is how the
dashboard finds the rank processes (their ``RANK``, the phase in ``MESHPACT_RUN_ID`` and
the ``MESHPACT_INCARNATION``) without any channel into the job: faults from the page
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
from pathlib import Path
from typing import Any, Sequence

from meshpact.core.errors import RecordingError
from meshpact.core.recording import Event, partial_path

__all__ = ["RankProcess", "RankRow", "rank_rows", "LiveJob", "tail_events", "job_processes", "failure_sentence",
           "TOKEN_ENV"]

TOKEN_ENV = "MESHPACT_DASHBOARD_JOB"


@dataclass(frozen=True)
class RankProcess:
    pid: int
    rank: int
    phase: str  # reference | faulted | cold (the trial's run id)
    incarnation: int
    stopped: bool  # SIGSTOPped (a stall in progress)


@dataclass(frozen=True)
class RankRow:
    """One row of the Live page's rank table: a rank process and what the recording last said of its rank."""

    rank: int
    pid: int
    incarnation: int
    phase: str
    state: str  # running | stopped (a stall in progress)
    last_event: str
    last_event_t: float | None  # recording time of that event


def rank_rows(procs: Sequence[RankProcess], events: Sequence[Event], phase: str | None = None) -> list[RankRow]:
    """A row per rank process of ``phase`` (all phases when None), newest incarnation of
    each rank, with the latest recorded event of that rank."""
    last: dict[int, Event] = {}
    for e in events:
        if e.rank is not None and (e.rank not in last or e.t >= last[e.rank].t):
            last[e.rank] = e
    newest: dict[int, RankProcess] = {}
    for p in procs:
        if phase is not None and p.phase != phase:
            continue
        if p.rank not in newest or p.incarnation >= newest[p.rank].incarnation:
            newest[p.rank] = p
    out = []
    for rank in sorted(newest):
        p, e = newest[rank], last.get(rank)
        out.append(RankRow(rank, p.pid, p.incarnation, p.phase, "stopped" if p.stopped else "running",
                           e.event if e else "", e.t if e else None))
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
                 runner: Sequence[str] = ("-m", "meshpact.app.live_job"), world_size: int = 0) -> None:
        self.token = uuid.uuid4().hex
        self.world_size = world_size
        self.recording = Path(recording)
        work = Path(tempfile.mkdtemp(prefix="meshpact-live-"))  # the runner's log and result, not the recordings
        self.result_path = work / "result.json"
        self.log_path = work / "runner.log"
        self.recording.parent.mkdir(parents=True, exist_ok=True)
        self.started = time.time()
        env = {**os.environ, TOKEN_ENV: self.token, "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, *runner, "--record", str(self.recording), "--result", str(self.result_path), *args]
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self._finalizer = weakref.finalize(self, _end, self.proc, self.token)
        weakref.finalize(self, shutil.rmtree, work, True)
        self.injected: list[dict[str, Any]] = []

    @property
    def running(self) -> bool:
        return self.proc.poll() is None

    @property
    def returncode(self) -> int | None:
        return self.proc.poll()

    def ranks(self) -> list[RankProcess]:
        out = []
        for pid, env in job_processes(self.token):
            if "RANK" not in env or pid == self.proc.pid:
                continue
            out.append(RankProcess(pid, int(env["RANK"]), env.get("MESHPACT_RUN_ID", "?"),
                                   int(env.get("MESHPACT_INCARNATION", "0") or 0), _state(pid) == "T"))
        return sorted(out, key=lambda r: (r.phase, r.rank, r.incarnation))

    def _rank(self, rank: int, phase: str | None) -> RankProcess:
        live = [r for r in self.ranks() if r.rank == rank and (phase is None or r.phase == phase)]
        if not live:
            where = f" in the {phase} run" if phase else ""
            raise LookupError(f"rank {rank} has no running process{where} right now")
        return live[-1]

    def kill_rank(self, rank: int, phase: str | None = "faulted") -> RankProcess:
        """SIGKILL the rank's process: the fault the runtime meets as a lost rank."""
        target = self._rank(rank, phase)
        _signal(target.pid, signal.SIGKILL)
        self.injected.append({"t": time.time() - self.started, "kind": "kill", "rank": rank, "pid": target.pid})
        return target

    def stall_rank(self, rank: int, seconds: float, phase: str | None = "faulted") -> RankProcess:
        """SIGSTOP the rank's process for ``seconds``, then SIGCONT: a stall past the timeout."""
        target = self._rank(rank, phase)
        _signal(target.pid, signal.SIGSTOP)
        timer = threading.Timer(seconds, _signal, args=(target.pid, signal.SIGCONT))
        timer.daemon = True
        timer.start()
        self.injected.append({"t": time.time() - self.started, "kind": "stall", "rank": rank, "pid": target.pid,
                              "seconds": seconds})
        return target

    def stop(self) -> None:
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


def tail_events(path: Path, offset: int = 0) -> tuple[list[Event], int]:
    """Events appended to the recording since byte ``offset``: read from ``<path>.partial``
    while it is written, else from the finished file. A line not yet ended is left for
    the next call. Returns the events and the new offset."""
    src = partial_path(path)
    if not src.exists():
        src = Path(path)
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
