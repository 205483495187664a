"""Shared by the recovery tests: one fault-free reference per (workload, ranks, steps, checkpoint
interval) in the whole session, whichever test file runs it first (``tests/_shared.py``)."""

from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path

from _shared import once
from _warm import shared_forkserver
from meshpact.core.recording import EventKind, read_recording
from meshpact.live.trials.trial import TrialConfig, TrialResult, run_trial

_ROOT = Path(tempfile.mkdtemp(prefix="meshpact-test-recovery-"))
atexit.register(shutil.rmtree, _ROOT, True)


def workload_file(tmp_path_factory, name: str, text: str) -> str:
    """A workload written as a user would (``text``), saved as ``<name>.py`` for a module's trials."""
    path = tmp_path_factory.mktemp(name) / f"{name}.py"
    path.write_text(text)
    return str(path)


def trial(**kw) -> TrialResult:
    """The trial, its fault-free reference run here unless a test of this session has run it."""
    cfg = TrialConfig(**kw)
    work = Path(tempfile.mkdtemp(prefix=f"{cfg.fault_kind.value}-", dir=_ROOT))
    ran: list[TrialResult] = []

    def run(ref: Path) -> TrialResult:
        # replacements forked too: these tests judge what a replacement does, not how fast it starts
        return run_trial(
            cfg, work_dir=work, reference_dir=ref / "reference", forkserver=shared_forkserver(), warm_replacements=True
        )

    # the trial that runs the reference holds the lock to its end: a reference is only known whole
    # once the trial has compared against it
    ref = once(
        f"a trial's fault-free reference: workload {cfg.workload}, {cfg.ranks} ranks, {cfg.steps} steps, "
        f"checkpoint every {cfg.checkpoint_every}, dispatch counted {cfg.count_dispatch}",
        lambda folder: ran.append(run(folder)),
    )
    return ran[0] if ran else run(ref)


def recoveries_told(result: TrialResult) -> str:
    """Every recovery of the run, one line each: the step, the policy and why, and what each
    rank that detected the fault was told (for a failure message: an unexpected recovery says
    here what started it)."""
    errors: dict[int, list[str]] = {}
    for e in result.events():
        if e.event == EventKind.DETECTED:
            errors.setdefault(int(e.data.get("generation", -1)), []).append(
                f"rank {e.rank}: {str(e.data.get('error'))[:160]}"
            )
    return "\n".join(
        f"step {r['step']} gen {r['generation']} {r['policy']}: {r['reason'][:200]} | detected at "
        f"generation {r['generation'] - 1}: {errors.get(r['generation'] - 1, ['?'])}"
        for r in result.recoveries()
    )


def assert_identical(result: TrialResult, faults_recovered: int | None = None, **policies: int) -> dict:
    """The run ended bit-identical with its reference, with ``faults_recovered`` faults recovered
    and each policy's count as given; a failure says what each recovery was told."""
    s = result.summary()
    told = recoveries_told(result)
    assert s["bit_identical"], (s["mismatches"], told)
    assert faults_recovered is None or s["faults_recovered"] == faults_recovered, told
    assert {p: s["policy_counts"][p] for p in policies} == policies, told
    return s


def assert_recovered(result: TrialResult, policy: str) -> dict:
    s = result.summary()
    assert s["bit_identical"], s["mismatches"]
    fired = {i: (rec.step, rec.rank) for i, rec in result.fault_records.items()}
    said = f"faults fired (step, rank): {fired}; recoveries:\n{recoveries_told(result)}"
    assert s["faults_injected"] == result.config.faults, said
    assert s["faults_recovered"] == s["faults_injected"], said
    assert s["policy_counts"][policy] >= s["faults_injected"], said
    assert s["old_group_ops_after_rebind"] == 0
    events = read_recording(s["recording"])
    stages = {e.stage.value for e in events if e.stage is not None}
    assert {"detection", "consensus", "communicator", "rebinding", "state"} <= stages
    return s
