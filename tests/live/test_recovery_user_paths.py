"""A user's own group, connection and errors under ``meshpact launch``, through faults of each kind.

The script (``_user_paths_job.py``) makes a metrics reducer whose ``self.pg`` is a ``new_group``
made after ``start_session``, talks to an echo service of the test's every step, and its data
fetch raises ``TimeoutError`` once on one rank. Faulted runs end bit-identical to a fault-free run
of the same script under plain ``torchrun``; the echo connection answered every step on every
rank; the user's ``TimeoutError`` reached the user's loop with no recovery started anywhere.

The fault count per kind is a parameter (``MESHPACT_USER_PATHS_FAULTS``, default 1 in the
suite, where time is short). A killed rank's replacement re-runs the start-up code, whose
``new_group`` after ``start_session`` is matched to the survivors' generation.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from _echo import EchoService

pytestmark = [pytest.mark.live, pytest.mark.slow]

RANKS = 3
JOB = Path(__file__).with_name("_user_paths_job.py")
FAULTS = int(os.environ.get("MESHPACT_USER_PATHS_FAULTS", "1"))
TIMEOUT_STEP, TIMEOUT_RANK = 1, 1  # no fault is placed at this step


def _plan(kinds: list[str], per_kind: int) -> tuple[int, list[str]]:
    """Faults of each kind at distinct steps from step 2 (a stall is judged from there), never at the
    step of the user's TimeoutError; ranks and collectives in turn. Returns the steps and the specs."""
    specs: list[str] = []
    step = 2
    for i in range(per_kind):
        for kind in kinds:
            rank = (i + len(specs)) % RANKS
            nth = 1 + len(specs) % 3
            specs.append(f"{kind}:{step}:{rank}:{nth}" if kind == "collective" else f"{kind}:{step}:{rank}")
            step += 2
    return step + 1, specs


def _run(launcher: list[str], out: Path, steps: int, echo: EchoService, faults: list[str], timeout_s: float) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    cmd = [
        *launcher,
        str(JOB),
        "--steps",
        str(steps),
        "--out",
        str(out),
        "--echo",
        str(echo.port),
        "--fetch-timeout",
        f"{TIMEOUT_STEP}:{TIMEOUT_RANK}",
        "--faults",
        ",".join(faults),
    ]
    with open(out / "launcher.log", "w") as log:  # every rank's events too (MESHPACT_TRACE), for a failure to explain
        rc = subprocess.run(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            timeout=timeout_s,
            start_new_session=True,
            env={**os.environ, "OMP_NUM_THREADS": "1", "MESHPACT_TRACE": "1"},
        ).returncode
    if (
        rc != 0
    ):  # each rank's detections and decisions in order (a step failed 8 times once, in a full run), then the end
        lines = (out / "launcher.log").read_text(errors="replace").splitlines()
        told = [
            line[:400]
            for line in lines
            if line.startswith("[meshpact rank") and ("'detected'" in line or "'decided'" in line)
        ]
        rest = [line for line in lines if not line.startswith("[meshpact rank")]
        raise AssertionError("\n".join(told[-60:] + ["..."] + rest[-40:]))
    finals = {}
    for r in range(RANKS):
        finals[r] = json.loads((out / f"rank{r}.json").read_text())
    return finals


def _check(reference: dict, faulted: dict, out: Path, steps: int, faults: int) -> None:
    assert {r: f["digest"] for r, f in faulted.items()} == {r: f["digest"] for r, f in reference.items()}
    recovered = {(x["step"]) for f in faulted.values() for x in f["recoveries"]}
    assert len(recovered) == faults, faulted  # every fault recovered, each once (ranks agree on the step)
    assert TIMEOUT_STEP not in recovered  # the user's error started no recovery on any rank
    for r, f in faulted.items():
        assert f["answered"] == steps - f["first_step"], f  # the echo connection answered every step
        # every evaluation's result as in the fault-free run (each rank's draw in it too, a run again included)
        assert f["evaluations"] == reference[r]["evaluations"][f["first_step"] :], r
    assert "UnreachableGroupWarning" not in (out / "launcher.log").read_text(errors="replace")  # self.pg is reached
    [timeout] = [
        json.loads(line) for path in sorted(out.glob("timeouts-rank*.jsonl")) for line in path.read_text().splitlines()
    ]
    assert timeout["rank"] == TIMEOUT_RANK and timeout["step"] == TIMEOUT_STEP
    assert timeout["type"] == "TimeoutError" and "did not answer" in timeout["message"]
    assert timeout["recoveries_before"] == timeout["recoveries_after"] == 0 and timeout["generation"] == 0


@pytest.fixture(scope="module")
def echo():
    service = EchoService()
    yield service
    service.close()


def test_a_users_group_connection_and_error_survive_raised_stalled_and_killed_ranks(tmp_path, echo):
    """One faulted run carries every kind (a kill among them: its replacement re-runs the user's
    start-up code, whose new_group after start_session joins the survivors' generation; an
    evaluation between steps that fails on one rank once its peers have gone on into the next step,
    which they leave to run it again with that rank)."""
    steps, faults = _plan(["collective", "stall", "kill", "eval"], FAULTS)
    kills = sum(1 for f in faults if f.startswith("kill"))
    budget = 120 + 60 * len(faults)
    reference = _run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(RANKS)],
        tmp_path / "reference",
        steps,
        echo,
        [],
        budget,
    )
    faulted = _run(
        [
            sys.executable,
            "-m",
            "meshpact.launch",
            "--standalone",
            "--nproc-per-node",
            str(RANKS),
            "--max-restarts",
            str(kills),
        ],
        tmp_path / "faulted",
        steps,
        echo,
        faults,
        budget,
    )
    _check(reference, faulted, tmp_path / "faulted", steps, len(faults))
