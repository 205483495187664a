"""The dashboard's live runner: one recovery trial, results as JSON (``python -m``).

Runs :func:`meshpact.live.trials.trial.run_trial` (a fault-free reference, the faulted run on
the in-memory recovery runtime, and the checkpoint baselines, on local gloo ranks bound
to 127.0.0.1), writes the recording as it goes and the trial's summary to ``--result``.
SIGTERM ends it cleanly, so the launcher's own clean-up stops every rank it started.

With ``--work-dir`` the trial runs there, so the dashboard can follow every rank's event
log and steer the ranks through the pace file (:class:`~meshpact.live.trials.trialconfig.Pace`).
The faults the dashboard injected by hand (kill, stall, partition: one JSON line each in
``<work-dir>/injected.jsonl``) are added to the recording as ``fault_injected`` events and
counted in the summary when the run ends, however it ends. Each is handed to the trial's own
analysis as the fault of the first recovery its ranks detected after it
(:func:`attribute_page_faults`), so the summary's downtime, detection and recovered faults
cover the recoveries a person caused, computed where the CLI's are.

Started by the dashboard (``MESHPACT_DASHBOARD_LEASE=stdin``), the runner holds a lease on
the dashboard's process: its stdin, a pipe whose other end the dashboard keeps. End of file
there (the dashboard let go of the job, or its process is gone, however it went) ends the run
as SIGTERM does (:func:`stop_when_parent_goes`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from meshpact.live.trials.analysis import TrialResult

# set to "stdin" by the dashboard: the runner's stdin is its lease on the dashboard's process
LEASE_ENV = "MESHPACT_DASHBOARD_LEASE"
INJECTED_FILE = "injected.jsonl"  # in the work directory: one line per fault injected from the page
TRIAL_DIR = "trial"  # under the work directory: the trial's own work directory (rank logs, pace file)


def injected_faults(work_dir: Path) -> list[dict[str, Any]]:
    """The faults injected from the page, in order (a torn last line is left out)."""
    try:
        lines = (work_dir / INJECTED_FILE).read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            out.append(dict(json.loads(line)))
        except (ValueError, TypeError):
            continue
    return out


def attribute_page_faults(result: "TrialResult", injected: list[dict[str, Any]]) -> int:
    """Hand the faulted run's faults sent from the page to the trial's analysis: each (in the
    order sent) is the fault of the first recovery of that run, not already a planned fault's,
    that its ranks detected after it was sent; it gets that recovery's step and its own wall
    time, as a planned fault's record has. A fault no recovery followed stays out. Returns how
    many were attributed."""
    from meshpact.live.recovery.faults import Fault, FaultKind
    from meshpact.live.trials.outcome import FaultRecord

    planned_steps = {r.step for r in result.fault_records.values()}
    free = sorted(
        (r for r in result.recoveries() if r["step"] not in planned_steps), key=lambda r: r["t_first_knew_wall"]
    )
    faults, records = list(result.faults), dict(result.fault_records)
    added = 0
    for f in sorted((f for f in injected if f.get("phase", "faulted") == "faulted"), key=lambda f: f["t_wall"]):
        rec = next((r for r in free if r["t_first_knew_wall"] >= float(f["t_wall"])), None)
        if rec is None:
            continue
        free.remove(rec)
        index = max([x.index for x in faults] + list(records), default=-1) + 1
        faults.append(Fault(index, FaultKind(f["kind"]), int(rec["step"]), int(f["rank"])))
        records[index] = FaultRecord(
            int(f["rank"]), int(rec["step"]), str(f["kind"]), float(f["t_wall"]), nonce="dashboard"
        )
        added += 1
    result.faults, result.fault_records = tuple(faults), records
    return added


def add_injected(
    recording: Path,
    injected: list[dict[str, Any]],
    summary: dict[str, Any] | None = None,
    recoveries: list[dict[str, Any]] | None = None,
) -> int:
    """Write ``injected`` into the finished ``recording`` as ``fault_injected`` events (at their
    time since the recording began) and count them in its summary event; one atomic
    replace. With ``summary`` and ``recoveries`` (the trial's, recomputed with the faults from
    the page attributed) the recording's summary and ``recovered`` events become those. Returns
    how many were added."""
    from meshpact.core.recording import Event, EventKind

    if not injected or not recording.exists():
        return 0
    events = [
        Event.from_dict(json.loads(ln), where=f"{recording}: event {n}")
        for n, ln in enumerate(recording.read_text().splitlines())
        if ln.strip()
    ]
    wall0 = float(events[0].data.get("wall_time", 0.0)) - events[0].t if events else 0.0
    added = [
        Event(
            float(f["t_wall"]) - wall0,
            EventKind.FAULT_INJECTED,
            int(f["rank"]),
            data={**{k: v for k, v in f.items() if k != "t_wall"}, "source": "dashboard"},
        )
        for f in injected
    ]
    out = []
    for e in events:
        if e.event == EventKind.RECOVERED and recoveries is not None:
            continue  # written anew before the summary
        if e.event == EventKind.SUMMARY:
            out.extend(added)
            added = []
            if recoveries is not None:
                out.extend(Event(e.t, EventKind.RECOVERED, data=r) for r in recoveries)
            data = (
                summary
                if summary is not None
                else {
                    **e.data,
                    "faults_injected": int(e.data.get("faults_injected") or 0) + len(injected),
                    "faults_from_page": len(injected),
                }
            )
            e = Event(e.t, e.event, e.rank, e.stage, data)
        out.append(e)
    out.extend(added)  # a run that ended before its summary
    tmp = recording.with_name(recording.name + ".tmp")
    tmp.write_text("".join(json.dumps(e.to_dict(), sort_keys=True, default=str) + "\n" for e in out))
    os.replace(tmp, recording)
    return len(injected)


def stop_when_parent_goes(lease_fd: int, gone: threading.Event | None = None) -> threading.Thread:
    """End this process as SIGTERM does once the file descriptor ``lease_fd`` (the stdin pipe
    from the dashboard) reaches end of file: the dashboard let go of the job, or its process
    is gone (``gone`` is set first). Read unbuffered, so the thread holds no lock the
    interpreter's exit waits for."""

    def hold() -> None:
        try:
            while os.read(lease_fd, 4096):
                pass
        except OSError:
            pass
        if gone is not None:
            gone.set()
        os.kill(os.getpid(), signal.SIGTERM)

    thread = threading.Thread(target=hold, name="meshpact-lease", daemon=True)
    thread.start()
    return thread


def _terminate(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    from meshpact.live.trials.trialconfig import ON_RANK_LOSS  # torch-free

    ap = argparse.ArgumentParser(prog="python -m meshpact.app.live_job")
    ap.add_argument("--record", required=True, type=Path)
    ap.add_argument("--result", required=True, type=Path)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--faults", type=int, default=2)
    ap.add_argument("--fault-kind", default="collective")
    ap.add_argument("--checkpoint-every", type=int, default=10)
    ap.add_argument("--timeout-s", type=float, default=300.0)
    ap.add_argument("--baselines", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--heartbeat", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--on-rank-loss", choices=list(ON_RANK_LOSS), default=ON_RANK_LOSS[0])
    ap.add_argument("--work-dir", type=Path, default=None)
    a = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, _terminate)
    gone = threading.Event()
    if os.environ.get(LEASE_ENV) == "stdin":
        stop_when_parent_goes(sys.stdin.fileno(), gone)
    try:
        return _trial(a)
    finally:
        if gone.is_set() and a.work_dir is not None:  # nobody is left to read the work directory
            shutil.rmtree(a.work_dir, ignore_errors=True)


def _trial(a: argparse.Namespace) -> int:
    """Run the trial ``a`` describes; write its result and, with page faults, its recording anew."""
    from meshpact.core.errors import MeshpactError
    from meshpact.live.trials.trial import TrialConfig, run_trial

    out: dict[str, Any] = {"ok": False, "error": "the run was stopped"}  # what a stop leaves
    try:
        cfg = TrialConfig(
            ranks=a.ranks,
            steps=a.steps,
            faults=a.faults,
            fault_kind=a.fault_kind,
            checkpoint_every=a.checkpoint_every,
            baselines=a.baselines,
            timeout_s=a.timeout_s,
            heartbeat=a.heartbeat,
            on_rank_loss=a.on_rank_loss,
            # ranks forked warm only where the page can read which is which (the launcher's
            # processes.jsonl in the work directory): a forked rank shows the server's environment
            warm_starts=a.work_dir is not None,
        )
        result = run_trial(
            cfg, recording_path=a.record, work_dir=None if a.work_dir is None else a.work_dir / TRIAL_DIR
        )
        page = injected_faults(a.work_dir) if a.work_dir is not None else []
        attributed = attribute_page_faults(result, page)
        summary = result.summary()
        if page:
            summary["faults_injected"] += len(page) - attributed  # sent, but no recovery followed
            summary["faults_from_page"] = len(page)
        out = {"ok": True, "summary": summary, "recoveries": result.recoveries()}
    except MeshpactError as exc:
        out = {"ok": False, "error": str(exc)}
    except Exception as exc:  # noqa: BLE001 - the page shows the reason as a sentence, never a traceback
        out = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    finally:
        injected = injected_faults(a.work_dir) if a.work_dir is not None else []
        ok = bool(out["ok"])
        add_injected(a.record, injected, out["summary"] if ok else None, out["recoveries"] if ok else None)
    a.result.write_text(json.dumps(out, default=str, indent=1))
    print(json.dumps({"ok": out["ok"]}), flush=True)
    return 0 if out["ok"] else 2


if __name__ == "__main__":
    from meshpact.exiting import run_then_exit

    run_then_exit(main)
