"""The launch drills' fault-free reference: the job under plain ``torchrun``, once per session.

Several drills compare their faulted job with the same fault-free one (the example script, four
ranks, ten steps); :func:`torchrun_reference` runs it in the first test that asks and hands the
next the same finals (``tests/_shared.py``)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from _shared import once
from meshpact.live.trials.launchdrill import EXAMPLE, Final, Job, read_finals


def torchrun_reference(
    ranks: int, steps: int, script: Path = EXAMPLE, script_args: Sequence[str] = (), timeout_s: float = 300.0
) -> dict[int, Final]:
    """What every rank of ``script`` ends with, run by plain ``torchrun --standalone`` without a fault."""

    def run(out: Path) -> None:
        with Job(
            Job.torchrun("--standalone", "--nproc-per-node", str(ranks)),
            out,
            steps,
            script=script,
            script_args=script_args,
        ) as ref:
            rc = ref.wait(timeout_s)
            if rc != 0:
                raise RuntimeError(f"the fault-free reference exited with {rc}:\n{ref.tail()}")

    out = once(f"torchrun --standalone --nproc-per-node {ranks} {script} --steps {steps} {' '.join(script_args)}", run)
    finals = read_finals(out, ranks)
    assert sorted(finals) == list(range(ranks)), f"the reference in {out} has finals of ranks {sorted(finals)} only"
    return finals
