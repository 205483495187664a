"""The README's loop (``_readme_loop.py``, the README's code block as it stands), run unchanged with a drill's eyes.

``meshpact launch`` or ``torchrun`` runs this file on every rank with ``--steps``, ``--step-s`` and
``--out`` (what :class:`~meshpact.live.trials.launchdrill.Job` passes). It runs the loop's file as
``__main__`` and watches it from outside the loop: after each step ``rt.step`` commits it writes
``progress-rank<r>.json`` (step, process, incarnation) and sleeps ``--step-s`` (so a drill can kill
a rank mid-run), and once the loop's last step (``--steps``) is committed it writes
``rank<r>.json`` with a digest of the rank's whole state, as ``examples/resilient_train.py`` does.
Python's and NumPy's generators, which the loop never seeds but a rank's state holds, are seeded
per rank before it starts, so two runs compare bit for bit.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import runpy
import time
from pathlib import Path

import numpy

from meshpact.live.recovery.runtime import Resilient
from meshpact.live.recovery.state import digest

LOOP = Path(__file__).with_name("_readme_loop.py")


def _write(path: Path, record: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, required=True, help="the loop's last step, as its code says")
    p.add_argument("--step-s", type=float, default=0.0)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    step_once = Resilient.step

    def watched(rt: Resilient, train_step, batch):
        out = step_once(rt, train_step, batch)
        s = rt.session
        _write(
            args.out / f"progress-rank{s.rank}.json",
            {"step": rt.committed_step - 1, "pid": os.getpid(), "incarnation": s.incarnation},
        )
        if rt.committed_step == args.steps:
            recoveries = [{"policy": r.policy.value, "step": r.step, "reason": r.reason} for r in rt.recoveries]
            _write(
                args.out / f"rank{s.rank}.json",
                {
                    "rank": s.rank,
                    "pid": os.getpid(),
                    "incarnation": s.incarnation,
                    "digest": digest(rt.state()),
                    "recoveries": recoveries,
                },
            )
        time.sleep(args.step_s)
        return out

    Resilient.step = watched  # type: ignore[method-assign, assignment]  # the README's loop, each step watched
    random.seed(int(os.environ["RANK"]))  # generators the loop leaves unseeded but its state holds: two runs compare
    numpy.random.seed(int(os.environ["RANK"]))
    runpy.run_path(str(LOOP), run_name="__main__")


if __name__ == "__main__":
    main()
