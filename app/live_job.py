"""The dashboard's live runner: one recovery trial, results as JSON (``python -m``).

Runs :func:`meshpact.live.recovery.trial.run_trial` (a fault-free reference, the faulted run on
the in-memory recovery runtime, and the checkpoint baselines, on local gloo ranks bound
to 127.0.0.1), writes the recording as it goes and the trial's summary to ``--result``.
SIGTERM ends it cleanly, so the launcher's own clean-up stops every rank it started.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path


def _terminate(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
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
    a = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, _terminate)

    from meshpact.core.errors import MeshpactError
    from meshpact.live.recovery.trial import TrialConfig, run_trial

    try:
        cfg = TrialConfig(ranks=a.ranks, steps=a.steps, faults=a.faults, fault_kind=a.fault_kind,
                          checkpoint_every=a.checkpoint_every, baselines=a.baselines, timeout_s=a.timeout_s)
        result = run_trial(cfg, recording_path=a.record)
        out = {"ok": True, "summary": result.summary(), "recoveries": result.recoveries()}
    except MeshpactError as exc:
        out = {"ok": False, "error": str(exc)}
    except Exception as exc:  # noqa: BLE001 - the page shows the reason as a sentence, never a traceback
        out = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    a.result.write_text(json.dumps(out, default=str, indent=1))
    print(json.dumps({"ok": out["ok"]}), flush=True)
    return 0 if out["ok"] else 2


if __name__ == "__main__":
    sys.exit(main())
