"""Drills for ``meshpact launch``: a job of the example script, a worker killed mid-run, what each rank ended with.

The tests and ``bench/launch.py`` share these: :class:`Job` starts one launcher command (``meshpact
launch`` or plain ``torchrun``, optionally inside a network namespace) on
``examples/resilient_train.py``; :meth:`Job.kill_rank` SIGKILLs one rank's process once the
rank has reported a step; :func:`read_finals` reads what every rank wrote at the end (process,
incarnation, digest of its whole state).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from ..recovery.jobkey import KEY_ENV, draw

__all__ = [
    "EXAMPLE",
    "Progress",
    "Final",
    "Job",
    "read_finals",
    "read_progress",
    "resumed_at",
    "excised_at",
    "excising_reference",
]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "resilient_train.py"


@dataclass(frozen=True)
class Progress:
    """A rank's last report (``progress-rank<r>.json``)."""

    rank: int
    step: int
    pid: int
    incarnation: int


@dataclass(frozen=True)
class Final:
    """What a rank wrote when training ended (``rank<r>.json``)."""

    rank: int
    pid: int
    incarnation: int
    digest: str
    recoveries: tuple[dict, ...] = ()  # policy, step, reason, detected and resumed (wall times)
    storage_bytes_read: int = 0  # checkpoint bytes this process read

    @property
    def policies(self) -> tuple[str, ...]:
        return tuple(str(r["policy"]) for r in self.recoveries)

    def recovered_by(self, *policies: str) -> bool:
        """Whether this rank's recoveries were exactly ``policies``, in order: a healthy job, however loaded,
        declares no fault of its own beside the drill's."""
        return self.policies == policies


def excised_at(final: Final) -> int | None:
    """The step a survivor's excision took effect at: its failed step less the steps it replayed
    in the smaller world (None: it excised nothing)."""
    steps = [int(r["step"]) - int(r.get("lost_steps", 0)) for r in final.recoveries if r["policy"] == "excise"]
    return steps[0] if len(steps) == 1 else None


def excising_reference(
    out: Path, steps: int, excise_at: int, world: int, survivors: int, timeout_s: float = 300.0
) -> dict[int, Final]:
    """The example's job with ranks ``survivors..world-1`` leaving before ``excise_at``, no fault
    (:mod:`meshpact.live.trials.launchref`, under plain torchrun): what each survivor ends with."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(world),
        "-m",
        "meshpact.live.trials.launchref",
        "--steps",
        str(steps),
        "--excise-at",
        str(excise_at),
        "--survivors",
        str(survivors),
        "--out",
        str(out),
    ]
    with open(out / "launcher.log", "w") as log:
        rc = subprocess.run(
            cmd, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s, env={**os.environ, "OMP_NUM_THREADS": "1"}
        ).returncode
    if rc != 0:
        raise RuntimeError(
            f"the excising reference exited with {rc}; its log ends:\n"
            f"{(out / 'launcher.log').read_text(errors='replace')[-4000:]}"
        )
    return read_finals(out, survivors)


def read_progress(out: Path, rank: int) -> Progress | None:
    try:
        d = json.loads((out / f"progress-rank{rank}.json").read_text())
    except (OSError, ValueError):
        return None
    return Progress(rank, int(d["step"]), int(d["pid"]), int(d["incarnation"]))


def read_finals(out: Path, ranks: int) -> dict[int, Final]:
    finals = {}
    for r in range(ranks):
        try:
            d = json.loads((out / f"rank{r}.json").read_text())
        except (OSError, ValueError):
            continue
        finals[r] = Final(
            r,
            int(d["pid"]),
            int(d["incarnation"]),
            str(d["digest"]),
            tuple(d.get("recoveries", ())),
            int(d.get("storage_bytes_read", 0)),
        )
    return finals


def _is_worker(pid: int, out: Path) -> bool:
    """Whether ``pid`` still runs the example with ``out`` (a pid the kernel handed on is left alone)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return False
    # a promoted spare runs the script in itself; a forked worker has its fork server's command line
    return str(out) in cmdline or any(
        m in cmdline for m in ("meshpact.live.launch.warmspare", "meshpact.live.launch.forkserver")
    )


def resumed_at(out: Path, ranks: Sequence[int], step: int, after: float) -> float | None:
    """When every rank of ``ranks`` had committed ``step`` again after wall time ``after`` (from
    ``steps-rank<r>.log``); None if one never did. ``resumed_at(...) - after`` is a fault's downtime
    as the job's progress shows it, whatever recovered it."""
    times = []
    for r in ranks:
        try:
            lines = (out / f"steps-rank{r}.log").read_text().split("\n")
        except OSError:
            return None
        hits = [float(t) for s, t in (ln.split() for ln in lines if ln.strip()) if int(s) == step and float(t) > after]
        if not hits:
            return None
        times.append(min(hits))
    return max(times)


class Job:
    """One launcher process running the example script; use as a context manager (killed on exit)."""

    def __init__(
        self,
        launcher: Sequence[str],
        out: Path,
        steps: int,
        step_s: float = 0.0,
        prefix: Sequence[str] = (),
        env: dict[str, str] | None = None,
        name: str = "launcher",
        script_args: Sequence[str] = (),
        script: Path = EXAMPLE,
    ) -> None:
        """``out``: the ranks' folder (several launchers of one job share it); ``name`` this launcher's log;
        ``script``: another training script taking ``--steps``, ``--step-s`` and ``--out``."""
        out.mkdir(parents=True, exist_ok=True)
        self.out = out
        self.log = out / f"{name}.log"
        cmd = [
            *prefix,
            *launcher,
            str(script),
            "--steps",
            str(steps),
            "--step-s",
            str(step_s),
            "--out",
            str(out),
            *script_args,
        ]
        self._log = open(self.log, "w")
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(
            cmd,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
        )

    @staticmethod
    def key_env() -> dict[str, str]:
        """A job key drawn for one job of several launchers, as the environment each of them is given
        (a job of several nodes needs the same key on every node: ``meshpact launch`` draws none)."""
        return {KEY_ENV: draw("drawn for a launch drill").secret.hex()}

    @staticmethod
    def meshpact(*flags: str, warm_start: bool = False) -> list[str]:
        """``meshpact launch`` with ``flags``; ``warm_start``: its workers forked from one process per
        node (``--warm-start``, for a drill that judges what the job recovers, not how fast a worker's
        interpreter starts), else fresh interpreters, as on default flags (what a bench times)."""
        return [sys.executable, "-m", "meshpact.launch", *(("--warm-start",) if warm_start else ()), *flags]

    @staticmethod
    def torchrun(*flags: str) -> list[str]:
        return [sys.executable, "-m", "torch.distributed.run", *flags]

    def wait_for_step(self, rank: int, step: int, timeout_s: float) -> Progress:
        """The rank's report once it has committed ``step`` (raises if the job ends or time runs out)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            p = read_progress(self.out, rank)
            if p is not None and p.step >= step:
                return p
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"the launcher exited with {self.proc.returncode} before rank {rank} reached step "
                    f"{step}; its log ends:\n{self.tail()}"
                )
            time.sleep(0.02)
        raise TimeoutError(f"rank {rank} did not reach step {step} within {timeout_s:.0f} s; log:\n{self.tail()}")

    def wait_for_log(self, text: str, timeout_s: float) -> None:
        """Until the launcher's log holds ``text`` (raises if the launcher ends or time runs out first)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if text in self.tail(1 << 20):
                return
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"the launcher exited with {self.proc.returncode} before its log said {text!r}; "
                    f"its log ends:\n{self.tail()}"
                )
            time.sleep(0.05)
        raise TimeoutError(f"the launcher's log did not say {text!r} within {timeout_s:.0f} s; log:\n{self.tail()}")

    def kill_rank(self, rank: int, after_step: int, timeout_s: float = 120.0) -> Progress:
        """SIGKILL ``rank``'s process once it has committed ``after_step``; returns the report it was killed at."""
        p = self.wait_for_step(rank, after_step, timeout_s)
        os.kill(p.pid, signal.SIGKILL)
        return p

    def kill_agent_and(self, workers: Sequence[Progress]) -> None:
        """A node lost whole: SIGKILL this launcher and ``workers`` at once (nothing stops anything). All are
        stopped first, so none of them acts on the others' deaths (a worker whose agent died before it, or
        an agent whose workers did) between two kills."""
        pids = [self.proc.pid, *(p.pid for p in workers)]
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        self.proc.wait(10)

    def wait(self, timeout_s: float) -> int:
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.close()
            raise TimeoutError(f"the launcher did not finish within {timeout_s:.0f} s; log:\n{self.tail()}") from None

    def tail(self, limit: int = 6000) -> str:
        if not self._log.closed:
            self._log.flush()
        text = self.log.read_text(errors="replace")
        return text[-limit:]

    def close(self) -> None:
        """Stop the launcher (SIGTERM: it stops its workers, as torchrun's agent does; SIGKILL after 10 s)
        and any worker of this job still running (a launcher killed outright leaves its workers)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        for rank in range(64):
            p = read_progress(self.out, rank)
            if p is not None and _is_worker(p.pid, self.out):
                os.kill(p.pid, signal.SIGKILL)
        self._log.close()

    def __enter__(self) -> "Job":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
