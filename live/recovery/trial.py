"""A recovery trial: a fault-free reference run, a faulted run, and the checkpoint baselines.

:func:`worker` is the entry point each rank runs (through the launcher or ``torchrun``): it
trains the harness model under :func:`~meshpact.live.recovery.runtime.resilient` for a number of
steps, with this rank's share of the fault plan, and can finish with a real checkpoint
restore in the job (the *drill*) or start as a *cold restart* from a checkpoint. It saves
its final local state and returns its events, recoveries and operation counts.

:func:`run_trial` drives one whole comparison from the parent: the reference, the faulted
run (starting a replacement for any rank killed with SIGKILL), and a cold restart; it
checks every rank's parameters and optimizer state with ``torch.equal`` against the
reference and writes all stage events to one JSONL recording.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from meshpact.core.errors import MeshpactError
from meshpact.core.recording import RecordingWriter
from meshpact.core.recovery import Policy, Stage

from .faults import Fault, FaultKind, NetnsPair, netns_unavailable, plan_faults
from ..launcher import Launch, LaunchError, host_store

__all__ = ["TrialConfig", "TrialResult", "worker", "run_trial"]


@dataclass(frozen=True)
class TrialConfig:
    ranks: int = 4
    steps: int = 40
    faults: int = 10
    fault_kind: FaultKind = FaultKind.COLLECTIVE
    checkpoint_every: int = 10
    data_timeout_s: float = 1.0
    control_timeout_s: float = 30.0
    stall_s: float = 1.5  # a stalled rank sleeps this long (past the data-path timeout)
    down_s: float = 2.0  # a partitioned data link stays down this long
    baselines: bool = True  # drill a checkpoint restore and a cold restart in the same run
    compile: bool = False
    count_ops: bool = True
    timeout_s: float = 300.0
    model: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "fault_kind", FaultKind(self.fault_kind))
        if self.ranks < 2:
            raise MeshpactError(f"--ranks must be at least 2 (a fault needs peers), got {self.ranks}")
        if self.steps < 2:
            raise MeshpactError(f"--steps must be at least 2, got {self.steps}")
        if self.checkpoint_every < 1 or self.checkpoint_every > self.steps:
            raise MeshpactError(f"--checkpoint-every must be between 1 and --steps ({self.steps}), "
                                f"got {self.checkpoint_every}")
        if self.fault_kind is FaultKind.STALL and self.stall_s <= self.data_timeout_s:
            raise MeshpactError(f"a stall ({self.stall_s} s) must outlast the data-path timeout "
                                f"({self.data_timeout_s} s)")
        if self.fault_kind is FaultKind.PARTITION and self.down_s <= self.data_timeout_s:
            raise MeshpactError(f"a partition ({self.down_s} s down) must outlast the data-path timeout "
                                f"({self.data_timeout_s} s), or the collective simply resumes")


# -- the rank side --------------------------------------------------------------------------
def worker(args: dict[str, Any]) -> dict[str, Any]:
    import torch

    from .faults import FaultInjector
    from .harness import ModelConfig, build, digest, local_state, make_batch, make_train_step
    from .runtime import RecoveryConfig, resilient, start_session

    torch.manual_seed(0)
    cfg = ModelConfig(**args.get("model", {}))
    config = RecoveryConfig(data_timeout_s=args["data_timeout_s"], control_timeout_s=args["control_timeout_s"],
                            checkpoint_dir=args.get("checkpoint_dir"), checkpoint_every=args["checkpoint_every"],
                            count_ops=args.get("count_ops", True))
    t_start = time.time()
    session = start_session(config)
    rank, steps = session.rank, int(args["steps"])
    session.attach_log(Path(args["out_dir"]) / f"events-rank{rank}-{session.incarnation}.jsonl")
    model, optimizer = build(cfg, session.mesh, compile=bool(args.get("compile")))
    train_step = make_train_step(model, optimizer)
    faults = tuple(Fault.from_dict(f) for f in args.get("faults", ()))
    injector = FaultInjector(faults, rank, session.control, args.get("stall_s", 0.0), args.get("down_s", 0.0))
    step_s: list[float] = []
    drill: dict[str, Any] | None = None
    cold_from = args.get("cold_from")
    with resilient(model, optimizer, session, injector) as rt:
        if cold_from is not None:
            rt._restore(int(cold_from))
            t_loaded = time.time()
        first = rt.committed_step
        for step in range(first, steps):
            t0 = time.perf_counter()
            rt.step(train_step, make_batch(cfg, step, rank))
            step_s.append(time.perf_counter() - t0)
        t_caught_up = time.time()
        if args.get("drill"):
            t0 = time.time()
            decision = rt.drill_checkpoint_restore()
            drill = {"t_start_wall": t0, "t_end_wall": time.time(), "checkpoint_step": decision.step,
                     "lost_steps": rt.recoveries[-1]["lost_steps"]}
        state = local_state(model, optimizer)
        out_dir = Path(args["out_dir"])
        torch.save({k: v.clone() for k, v in state.items()}, out_dir / f"final-rank{rank}.pt")
        counts = rt.op_counts()
        retired = [{"group": r["group"], "ops_at_retirement": r["ops_at_retirement"],
                    "seq_ops_after": r["seq_ops_after"],
                    "ops_after": counts.get(r["group"], 0) - (r["ops_at_retirement"] or 0),
                    "alive": r["ref"]() is not None} for r in rt.retired]
        result = {"rank": rank, "incarnation": session.incarnation, "digest": digest(state),
                  "events": session.events, "recoveries": rt.recoveries, "op_counts": counts,
                  "retired": retired, "current_group": session.group.group_name, "step_s": step_s,
                  "generation": session.generation, "drill": drill, "t_start_wall": t_start,
                  "t_caught_up_wall": t_caught_up}
        if args.get("compile"):
            from torch._dynamo.utils import counters

            result["compiled_graphs"] = int(counters["stats"]["unique_graphs"])
        if cold_from is not None:
            result["t_loaded_wall"] = t_loaded
        if rank == 0:
            result["fault_records"] = session.control.present([f"fault/{f.index}" for f in faults])
    return result


# -- the parent side ------------------------------------------------------------------------
@dataclass
class TrialResult:
    config: TrialConfig
    faults: tuple[Fault, ...]
    reference: list[dict[str, Any]]
    faulted: list[dict[str, Any]]
    cold: list[dict[str, Any]] | None
    fault_records: dict[int, dict[str, Any]]
    bit_identical: bool
    mismatches: list[str]
    replacements: int
    recording: str
    cold_launch_wall: float | None = None
    faulted_events: list[dict[str, Any]] = field(default_factory=list)

    # -- the numbers ------------------------------------------------------------------------
    def events(self) -> list[dict[str, Any]]:
        """Every rank's events from the faulted run, replacements and killed processes included."""
        return self.faulted_events

    def recoveries(self) -> list[dict[str, Any]]:
        """One entry per recovered fault: policy, downtime and stage durations (slowest rank)."""
        by_gen: dict[int, list[dict]] = {}
        per_rank: dict[tuple[int, int, str], float] = {}
        gen_of: dict[tuple[int, int], int] = {}
        for ev in sorted(self.faulted_events, key=lambda e: e["t_wall"]):
            key_rank = (ev["rank"], ev.get("pid", 0))
            if ev["event"] == "decided":
                gen_of[key_rank] = ev["data"]["round"]
            gen = gen_of.get(key_rank)
            if ev["event"] == "recovery_done":
                by_gen.setdefault(ev["data"]["generation"], []).append(ev["data"])
            elif gen is not None and ev["stage"] and "seconds" in ev["data"]:
                key = (gen, ev["rank"], ev["stage"])
                per_rank[key] = per_rank.get(key, 0.0) + float(ev["data"]["seconds"])
        stage_by_gen: dict[int, dict[str, float]] = {}
        for (gen, _, stage), sec in per_rank.items():
            d = stage_by_gen.setdefault(gen, {})
            d[stage] = max(d.get(stage, 0.0), sec)
        out = []
        for gen in sorted(by_gen):
            recs = by_gen[gen]
            if any(r.get("drill") for r in recs):
                continue
            step = min(r["step"] for r in recs)
            t_inject = self._inject_time(step)
            stages = dict(stage_by_gen.get(gen, {}))
            t_detect = max(r["t_detect_wall"] for r in recs)
            stages[Stage.DETECTION.value] = max(0.0, t_detect - t_inject) if t_inject else 0.0
            t_resumed = max(r["t_resumed_wall"] for r in recs)
            # from the moment every rank knew of the fault to the moment every rank could resume:
            # consensus, communicator, rebinding and state, with no detection skew counted in
            recovery_s = t_resumed - t_detect
            out.append({"generation": gen, "step": step, "policy": recs[0]["policy"], "reason": recs[0]["reason"],
                        "stages_s": stages, "recovery_s": recovery_s,
                        "downtime_s": (t_resumed - t_inject) if t_inject else None,
                        "rebind_s": max(r["rebind_s"] for r in recs),
                        "lost_steps": max(r["lost_steps"] for r in recs)})
        return out

    def _inject_time(self, step: int) -> float | None:
        for f in self.faults:
            rec = self.fault_records.get(f.index)
            if rec and rec["step"] == step:
                return float(rec["t_wall"])
        return None

    def policy_counts(self) -> dict[str, int]:
        counts = {p.value: 0 for p in Policy}
        for r in self.recoveries():
            counts[r["policy"]] += 1
        return counts

    def downtime(self) -> dict[str, float | None]:
        recs = self.recoveries()
        mem = [r["downtime_s"] for r in recs if r["policy"] == Policy.IN_MEMORY.value and r["downtime_s"] is not None]
        detection = [r["stages_s"][Stage.DETECTION.value] for r in recs]
        det = statistics.median(detection) if detection else 0.0
        drills = [res["drill"] for res in self.faulted if res.get("drill")]
        ckpt = (self.outage_s(det, restart=False) + max(d["t_end_wall"] for d in drills)
                - min(d["t_start_wall"] for d in drills)) if drills else None
        cold = None
        if self.cold and self.cold_launch_wall is not None:
            caught_up = max(r["t_caught_up_wall"] for r in self.cold)
            cold = self.outage_s(det, restart=True) + caught_up - self.cold_launch_wall
        return {Policy.IN_MEMORY.value: statistics.median(mem) if mem else None,
                Policy.CHECKPOINT_RESTORE.value: ckpt, Policy.COLD_RESTART.value: cold}

    def outage_s(self, detection_s: float, restart: bool) -> float:
        """How long after the fault a baseline can start its own work: detection, or longer
        where the fault itself must clear first. Every policy waits for a downed data link to
        come back; an in-job restore also waits for a stalled rank, which a cold restart kills."""
        clears = 0.0
        if self.config.fault_kind is FaultKind.PARTITION:
            clears = self.config.down_s
        elif self.config.fault_kind is FaultKind.STALL and not restart:
            clears = self.config.stall_s
        return max(detection_s, clears)

    def faults_recovered(self) -> int:
        """Faults that fired, were followed by a recovery at their step, and left the final state
        bit-identical to the reference."""
        if not self.bit_identical:
            return 0
        steps = {r["step"] for r in self.recoveries()}
        return sum(1 for rec in self.fault_records.values() if rec["step"] in steps)

    def old_group_ops_after_rebind(self) -> int:
        """Operations the retired groups received after their rebind, by both counters: the
        dispatcher-level count (when counting is on) and the backend's own sequence number over
        the step that followed the rebind."""
        return sum(r["ops_after"] + (r["seq_ops_after"] or 0) for res in self.faulted for r in res["retired"])

    def summary(self) -> dict[str, Any]:
        recs = self.recoveries()
        rebind = sorted(r["rebind_s"] * 1e3 for r in recs)
        down = self.downtime()
        return {
            "ranks": self.config.ranks, "steps": self.config.steps, "fault_kind": self.config.fault_kind.value,
            "faults_injected": len(self.fault_records),
            "faults_recovered": self.faults_recovered(),
            "bit_identical": self.bit_identical,
            "policy_counts": self.policy_counts(),
            "rebind_ms": {"median": statistics.median(rebind) if rebind else None,
                          "max": max(rebind) if rebind else None},
            "downtime_s": {"in_memory": down["in_memory"], "checkpoint_restore": down["checkpoint_restore"],
                           "cold_restart": down["cold_restart"]},
            "recording": self.recording,
            "recovery_ms": {"median": statistics.median([r["recovery_s"] * 1e3 for r in recs]) if recs else None,
                            "max": max([r["recovery_s"] * 1e3 for r in recs], default=None)},
            "old_group_ops_after_rebind": self.old_group_ops_after_rebind(),
            "retired_groups_still_referenced": sum(r["alive"] for res in self.faulted for r in res["retired"]),
            "replacement_processes": self.replacements,
            "mismatches": self.mismatches[:5],
        }


def _compare(a_dir: Path, b_dir: Path, ranks: int) -> list[str]:
    import torch

    bad = []
    for r in range(ranks):
        a = torch.load(a_dir / f"final-rank{r}.pt", weights_only=True)
        b = torch.load(b_dir / f"final-rank{r}.pt", weights_only=True)
        if a.keys() != b.keys():
            bad.append(f"rank {r}: different tensors {sorted(set(a) ^ set(b))[:3]}")
            continue
        bad += [f"rank {r}: {k} differs" for k in a if not torch.equal(a[k], b[k])]
    return bad


def _run(cfg: TrialConfig, tag: str, work: Path, faults: tuple[Fault, ...], extra: dict[str, Any],
         netns: NetnsPair | None, stores: dict[str, int] | None, recording: RecordingWriter
         ) -> tuple[list[dict], int, float]:
    out_dir = Path(extra.get("out_dir", work / tag))
    out_dir.mkdir(parents=True, exist_ok=True)
    args = {"steps": cfg.steps, "checkpoint_every": cfg.checkpoint_every, "data_timeout_s": cfg.data_timeout_s,
            "control_timeout_s": cfg.control_timeout_s, "stall_s": cfg.stall_s, "down_s": cfg.down_s,
            "checkpoint_dir": str(work / "checkpoints"), "out_dir": str(out_dir), "model": cfg.model,
            "faults": [f.to_dict() for f in faults], "compile": cfg.compile, "count_ops": cfg.count_ops, **extra}
    replacements = 0

    def on_exit(job: Launch, rank: int, rc: int) -> None:
        nonlocal replacements
        if rc == -9:  # SIGKILL: start a replacement that joins the recovery in progress
            replacements += 1
            recording.emit("replacement_started", rank=rank, stage=Stage.RESTART, data={"returncode": rc})
            job.replace(rank)

    control = None
    if netns is not None and stores is not None:
        kw: dict[str, Any] = dict(
            master_addr=netns.data_ip[0], master_port=stores["data_port"], host_stores=False,
            prefix=lambda r: netns.prefix(netns.side(r, cfg.ranks)),
            env=lambda r: {**netns.rank_env(r, cfg.ranks), "MESHPACT_RUN_ID": tag,
                           "MESHPACT_CONTROL_PORT": str(stores["control_port"])})
    else:
        control = host_store("127.0.0.1", 0, cfg.ranks)
        kw = dict(env=lambda r: {"MESHPACT_CONTROL_ADDR": "127.0.0.1", "MESHPACT_RUN_ID": tag,
                                 "MESHPACT_CONTROL_PORT": str(control.port)})
    t_launch = time.time()
    with Launch("meshpact.live.recovery.trial:worker", cfg.ranks, args, timeout_s=cfg.timeout_s, **kw) as job:
        results = job.wait(on_exit=on_exit)
    bad = [r for r in results if not r.ok]
    if bad:
        raise LaunchError(f"{tag} run: rank {bad[0].rank} "
                          f"{'timed out' if bad[0].returncode is None else f'exited with {bad[0].returncode}'}"
                          f" (limit {cfg.timeout_s:.0f} s); its stderr ends:\n{bad[0].stderr_tail}")
    del control
    return [r.value for r in results], replacements, t_launch


def run_trial(cfg: TrialConfig, recording_path: str | os.PathLike[str] | None = None,
              work_dir: str | os.PathLike[str] | None = None,
              reference_dir: str | os.PathLike[str] | None = None) -> TrialResult:
    """Run the trial in ``work_dir``; without one, in a scratch directory that is removed after
    (kept when the recording would live in it, i.e. no ``recording_path`` either)."""
    if work_dir is not None or recording_path is None:
        return _run_trial(cfg, recording_path, work_dir, reference_dir)
    with tempfile.TemporaryDirectory(prefix="meshpact-trial-") as scratch:
        return _run_trial(cfg, recording_path, scratch, reference_dir)


def _run_trial(cfg: TrialConfig, recording_path: str | os.PathLike[str] | None = None,
              work_dir: str | os.PathLike[str] | None = None,
              reference_dir: str | os.PathLike[str] | None = None) -> TrialResult:
    """Reference, faulted run and baselines for ``cfg``; see the module docstring.

    ``reference_dir`` holding ``final-rank<r>.pt`` from an earlier fault-free run of the same
    ranks, steps and model is compared against instead of running the reference again.
    """
    if cfg.fault_kind is FaultKind.PARTITION:
        why = netns_unavailable()
        if why:
            raise MeshpactError(f"cannot inject partition faults here: {why}")
    work = Path(work_dir or tempfile.mkdtemp(prefix="meshpact-trial-"))
    work.mkdir(parents=True, exist_ok=True)
    recording_path = Path(recording_path or work / "recording.jsonl")
    faults = plan_faults(cfg.fault_kind, cfg.steps, cfg.faults, cfg.ranks,
                         injector_ranks=(0,) if cfg.fault_kind is FaultKind.PARTITION else None)
    cold = None
    cold_launch = None
    with RecordingWriter(recording_path, "live", kind="recovery_trial", ranks=cfg.ranks, steps=cfg.steps,
                         fault_kind=cfg.fault_kind.value, faults=len(faults)) as rec:
        t0_wall = time.time() - rec.now()
        netns = NetnsPair() if cfg.fault_kind is FaultKind.PARTITION else None
        store_host = None
        try:
            stores: dict[str, int] | None = None
            if netns is not None:
                netns.__enter__()
                store_host, stores = _serve_stores_in(netns)
            ref_dir = Path(reference_dir) if reference_dir else work / "reference"
            if reference_dir and all((ref_dir / f"final-rank{r}.pt").exists() for r in range(cfg.ranks)):
                reference: list[dict[str, Any]] = []
            else:
                reference, _, _ = _run(cfg, "reference", ref_dir.parent, (),
                                       {"checkpoint_dir": str(ref_dir.parent / "ref-checkpoints"),
                                        "out_dir": str(ref_dir)}, netns, stores, rec)
            faulted, replacements, _ = _run(cfg, "faulted", work, faults, {"drill": cfg.baselines}, netns, stores, rec)
            if cfg.baselines:
                drill = faulted[0]["drill"]
                cold, _, cold_launch = _run(cfg, "cold", work, (), {"cold_from": drill["checkpoint_step"]},
                                            netns, stores, rec)
        finally:
            if store_host is not None:
                store_host.kill()
                store_host.wait(timeout=10)
            if netns is not None:
                netns.close()
        fault_records = _fault_records(faulted, faults)
        faulted_events = _read_events(work / "faulted")
        mismatches = _compare(ref_dir, work / "faulted", cfg.ranks)
        if cold is not None:
            mismatches += [f"cold restart: {m}" for m in _compare(ref_dir, work / "cold", cfg.ranks)]
        cold_events = [e for res in (cold or []) for e in res["events"]]
        for ev in sorted(faulted_events + cold_events, key=lambda e: e["t_wall"]):
            rec.emit(ev["event"], rank=ev["rank"], stage=ev["stage"], data=ev["data"], t=ev["t_wall"] - t0_wall)
        for f in faults:
            r = fault_records.get(f.index)
            if r:
                rec.emit("fault_injected", rank=f.rank, data={**f.to_dict(), **r}, t=r["t_wall"] - t0_wall)
        result = TrialResult(cfg, faults, reference, faulted, cold, fault_records, not mismatches, mismatches,
                             replacements, str(recording_path), cold_launch, faulted_events)
        for r in result.recoveries():
            rec.emit("recovered", data=r)
        rec.emit("summary", data=result.summary())
    return result


def _read_events(out_dir: Path) -> list[dict[str, Any]]:
    import json

    events = []
    for path in sorted(out_dir.glob("events-rank*.jsonl")):
        incarnation = int(path.stem.rsplit("-", 1)[1])
        for line in path.read_text().splitlines():
            if line.strip():
                ev = json.loads(line)
                ev["pid"] = incarnation
                events.append(ev)
    return events


def _fault_records(faulted: list[dict[str, Any]], faults: tuple[Fault, ...]) -> dict[int, dict[str, Any]]:
    """When each fault fired, as claimed on the control channel."""
    out: dict[int, dict[str, Any]] = {}
    for res in faulted:
        for key, value in (res.get("fault_records") or {}).items():
            out[int(key.split("/")[1])] = dict(value)
    return out


def _serve_stores_in(netns: NetnsPair) -> tuple[subprocess.Popen, dict[str, int]]:
    """Host the rendezvous and control stores inside the first namespace, on their own links."""
    cmd = [*netns.prefix(0), sys.executable, "-m", "meshpact.live.launcher", "--serve-stores",
           f"{netns.data_ip[0]}:0", f"{netns.ctrl_ip[0]}:0"]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline().split() if proc.stdout else []
    if len(line) != 3 or line[0] != "PORTS":
        proc.kill()
        raise MeshpactError(f"the store host in {netns.ns[0]} did not start (said {line!r})")
    return proc, {"data_port": int(line[1]), "control_port": int(line[2])}
