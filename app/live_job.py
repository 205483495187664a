"""The dashboard's live runner: one recovery trial, results as JSON (``python -m``).

Runs :func:`meshpact.live.trials.trial.run_trial` (a fault-free reference, the faulted run on
the in-memory recovery runtime, and the checkpoint baselines, on local gloo ranks bound
to 127.0.0.1), writes the recording as it goes and the trial's summary to ``--result``.
SIGTERM ends it cleanly, so the launcher's own clean-up stops every rank it started.

With ``--work-dir`` the trial runs there, so the dashboard can follow every rank's event
log and steer the ranks through the pace file (:class:`~meshpact.live.trials.trialconfig.Pace`).
The faults the dashboard injected by hand (kill, stall, partition: one JSON line each in
``<work-dir>/injected.jsonl``) are added to the recording as ``fault_injected`` events and
counted in the summary when the run ends, however it ends.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

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


def add_injected(recording: Path, injected: list[dict[str, Any]]) -> int:
    """Write ``injected`` into the finished ``recording`` as ``fault_injected`` events (at their
    time since the recording began) and count them in its summary event; one atomic
    replace. Returns how many were added."""
    from meshpact.core.recording import Event, EventKind

    if not injected or not recording.exists():
        return 0
    events = [Event.from_dict(json.loads(ln), where=f"{recording}: event {n}")
              for n, ln in enumerate(recording.read_text().splitlines()) if ln.strip()]
    wall0 = float(events[0].data.get("wall_time", 0.0)) - events[0].t if events else 0.0
    added = [Event(float(f["t_wall"]) - wall0, EventKind.FAULT_INJECTED, int(f["rank"]),
                   data={**{k: v for k, v in f.items() if k != "t_wall"}, "source": "dashboard"}) for f in injected]
    out = []
    for e in events:
        if e.event == EventKind.SUMMARY:
            out.extend(added)
            added = []
            e = Event(e.t, e.event, e.rank, e.stage, {**e.data, "faults_injected": int(e.data.get("faults_injected") or 0)
                                                      + len(injected), "faults_from_page": len(injected)})
        out.append(e)
    out.extend(added)  # a run that ended before its summary
    tmp = recording.with_name(recording.name + ".tmp")
    tmp.write_text("".join(json.dumps(e.to_dict(), sort_keys=True) + "\n" for e in out))
    os.replace(tmp, recording)
    return len(injected)


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

    from meshpact.core.errors import MeshpactError
    from meshpact.live.trials.trial import TrialConfig, run_trial

    try:
        cfg = TrialConfig(ranks=a.ranks, steps=a.steps, faults=a.faults, fault_kind=a.fault_kind,
                          checkpoint_every=a.checkpoint_every, baselines=a.baselines, timeout_s=a.timeout_s,
                          heartbeat=a.heartbeat, on_rank_loss=a.on_rank_loss,
                          # ranks forked warm only where the page can read which is which (the launcher's
                          # processes.jsonl in the work directory): a forked rank shows the server's environment
                          warm_starts=a.work_dir is not None)
        result = run_trial(cfg, recording_path=a.record,
                           work_dir=None if a.work_dir is None else a.work_dir / TRIAL_DIR)
        out = {"ok": True, "summary": result.summary(), "recoveries": result.recoveries()}
    except MeshpactError as exc:
        out = {"ok": False, "error": str(exc)}
    except Exception as exc:  # noqa: BLE001 - the page shows the reason as a sentence, never a traceback
        out = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    finally:
        injected = injected_faults(a.work_dir) if a.work_dir is not None else []
        add_injected(a.record, injected)
    if out["ok"] and injected:
        out["summary"]["faults_injected"] = int(out["summary"].get("faults_injected") or 0) + len(injected)
        out["summary"]["faults_from_page"] = len(injected)
    a.result.write_text(json.dumps(out, default=str, indent=1))
    print(json.dumps({"ok": out["ok"]}), flush=True)
    return 0 if out["ok"] else 2


if __name__ == "__main__":
    sys.exit(main())
