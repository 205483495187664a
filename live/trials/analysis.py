"""The analysis of a recovery trial: recoveries, stage times, downtime and the bit-identity check.

:class:`TrialResult` holds what the parent collected from every rank (their results and
their event logs, as :class:`~meshpact.core.recording.Event` records with wall times) and
derives the numbers: one entry per recovered fault with its stage durations (critical path),
downtime per policy against the fault's own injection time and what each figure includes
(:meth:`TrialResult.downtime_includes`), operations the retired groups received, and the
``--json`` summary. :func:`compare_final` is the bit-identity check: every
tensor of every rank's final state (parameter shards, optimizer state and generators) with
``torch.equal``.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from meshpact.core.jsonform import JsonObject
from meshpact.core.recording import Event, EventKind
from meshpact.core.recovery import Policy, Stage

from ..recovery.faults import Fault, FaultKind
from .outcome import FaultRecord, RankOutcome
from .trialconfig import TrialConfig

# the stages a recovery's events end, after detection (measured from the injection) and before
# any replay (derived by the simulator from the steps lost); a replacement's start is inside the
# survivors' consensus, which waits for it
_SEGMENT_STAGES = frozenset({Stage.CONSENSUS, Stage.COMMUNICATOR, Stage.REBINDING, Stage.STATE})

__all__ = [
    "TrialResult",
    "ExcisionPlan",
    "ExcisionResult",
    "ReplacementStart",
    "compare_final",
    "heard_spread_ms",
    "recovery_span",
]


class ReplacementStart(str, Enum):
    """How a lost rank's replacement process starts (the same in every run of one trial)."""

    FRESH = "a new process, a fresh interpreter that imports torch"
    WARM_SPARE = "a warm spare, its imports done before the fault"
    FORKED = "a process forked from a server that imported torch, no real start"


@dataclass(frozen=True)
class ExcisionPlan:
    """One excision a faulted run decided: the committed step the survivors went on from and
    the original ranks that left (what the excising reference replays without a fault)."""

    step: int
    lost: tuple[int, ...]


@dataclass(frozen=True)
class ExcisionResult:
    """An excising trial judged: the survivors against the excising reference (bitwise) and
    against the never-failed run (largest absolute difference of the whole tensors)."""

    plan: tuple[ExcisionPlan, ...]
    equal_to_excising_reference: bool
    mismatches: list[str]
    max_abs_diff_from_unfailed: float | None
    refused: str | None  # the one-line stop below --min-ranks
    flushed_checkpoint: str | None

    def view(self) -> JsonObject:
        return {
            "excisions": [{"step": p.step, "lost": list(p.lost)} for p in self.plan],
            "equal_to_excising_reference": self.equal_to_excising_reference,
            "max_abs_diff_from_unfailed": self.max_abs_diff_from_unfailed,
            "refused": self.refused,
            "flushed_checkpoint": self.flushed_checkpoint,
        }


@dataclass
class TrialResult:
    """Everything the parent collected from one trial; the methods derive the numbers."""

    config: TrialConfig
    faults: tuple[Fault, ...]
    reference: list[RankOutcome]
    faulted: list[RankOutcome]
    cold: list[RankOutcome] | None
    fault_records: dict[int, FaultRecord]
    bit_identical: bool
    mismatches: list[str]
    replacements: int
    recording: str
    cold_launch_wall: float | None = None
    faulted_events: list[Event] = field(default_factory=list)  # t: wall time
    excision: ExcisionResult | None = None  # --on-rank-loss excise: the judgement against the excising reference
    # a trial whose faults cost a process: the checkpoint-restore baseline measured on the same losses (the same
    # faults, no peer copies, the replacement started the same way), as a result of its own; None: the drill
    checkpoint_baseline: "TrialResult | None" = None
    cold_replays: int | None = None  # steps the cold restart replays to catch up (None: to the end of the run)
    replacement_start: ReplacementStart = ReplacementStart.FRESH

    # -- the numbers ------------------------------------------------------------------------
    def events(self) -> list[Event]:
        """Every rank's events from the faulted run, replacements and killed processes included."""
        return self.faulted_events

    def recoveries(self) -> list[dict[str, Any]]:
        """One entry per recovered fault: policy, downtime and its stages along the critical path.

        Detection lasts from the injection until every survivor knew. Each later stage ends when
        the last rank ended it: the ranks' events of one kind (decided, rebuilt, rebound,
        retained or reloaded, ready, the first collective) end a segment at the latest of them,
        and the segment since the previous one is that stage's. So the stages add up to the
        downtime (less any replay, a stage of its own that the simulator derives from the steps
        lost), and a rank that waited inside one stage for a slower rank's earlier stage is not
        counted twice, as a sum of per-stage maxima over ranks would."""
        by_gen: dict[int, list[dict]] = {}
        ends: dict[
            int, dict[tuple[EventKind | str, Stage], float]
        ] = {}  # gen -> (event kind, stage) -> last rank's end

        def ended(gen: int, key: tuple[EventKind | str, Stage], t: float) -> None:
            mine = ends.setdefault(gen, {})
            mine[key] = max(mine.get(key, t), t)

        gen_of: dict[tuple[int, int], int] = {}
        incarnation_of: dict[int, int] = {}
        for ev in sorted(self.faulted_events, key=lambda e: e.t):
            if ev.event == EventKind.SESSION_START:
                incarnation_of[ev.rank or 0] = int(ev.data.get("incarnation", 0))
            key_rank = (ev.rank or 0, incarnation_of.get(ev.rank or 0, 0))
            if ev.event == EventKind.DECIDED:
                gen_of[key_rank] = ev.data["round"]
            gen = gen_of.get(key_rank)
            if ev.event == EventKind.RECOVERY_DONE:
                by_gen.setdefault(ev.data["generation"], []).append(dict(ev.data))
            elif gen is None:
                continue
            elif (
                ev.event == EventKind.FIRST_COLLECTIVE
            ):  # part of the communicator stage (new group + first collective)
                ended(gen, (ev.event, Stage.COMMUNICATOR), float(ev.data.get("t_done_wall", ev.t)))
            elif ev.stage in _SEGMENT_STAGES and "seconds" in ev.data:
                ended(gen, (ev.event, ev.stage), ev.t)
        out = []
        for gen in sorted(by_gen):
            recs = by_gen[gen]
            if any(r.get("drill") for r in recs):
                continue
            step = min(r["step"] for r in recs)
            t_inject = self._inject_time(step)
            t_detect, t_resumed = recovery_span(recs)
            t_all_knew = max(r["t_detect_wall"] for r in recs)
            stages: dict[str, float] = {Stage.DETECTION.value: max(0.0, t_all_knew - t_inject) if t_inject else 0.0}
            t_prev = t_all_knew
            for (_, stage), t_end in sorted(ends.get(gen, {}).items(), key=lambda kv: kv[1]):
                if t_end > t_resumed:  # a rank's event after this recovery ended is not part of it
                    continue
                stages[stage.value] = stages.get(stage.value, 0.0) + max(0.0, t_end - t_prev)
                t_prev = max(t_prev, t_end)
            first_collective_s = max(r["t_resumed_wall"] - r["t_first_collective_wall"] for r in recs)
            out.append(
                {
                    "generation": gen,
                    "step": step,
                    "policy": recs[0]["policy"],
                    "reason": recs[0]["reason"],
                    "stages_s": stages,
                    "recovery_s": t_resumed - t_detect,
                    "detection_s": max(0.0, t_detect - t_inject) if t_inject else 0.0,
                    "t_first_knew_wall": t_detect,
                    "t_all_resumed_wall": t_resumed,
                    "knew_spread_s": t_all_knew - t_detect,  # the first rank knowing -> every rank knowing
                    "first_collective_s": first_collective_s,
                    "downtime_s": (t_resumed - t_inject) if t_inject else None,
                    "rebind_s": max(r["rebind_s"] for r in recs),
                    "rebind_cpu_s": max(r.get("rebind_cpu_s", 0.0) for r in recs),
                    "cpu_s": sum(r.get("cpu_s", 0.0) for r in recs),  # every rank's process, summed
                    "lost_steps": max(r["lost_steps"] for r in recs),
                }
            )
        return out

    def fault_to_running_ms(self, policy: str | None = None) -> list[float]:
        """Per recovery (of ``policy``, or every one), the downtime a user sees: the fault's
        injection until every rank ran its first collective on the new group (detection, the
        recovery and any replay included), in ms. A recovery whose fault has no injection time
        (none was recorded at its step) is left out."""
        return [
            r["downtime_s"] * 1e3
            for r in self.recoveries()
            if r["downtime_s"] is not None and (policy is None or r["policy"] == policy)
        ]

    def _inject_time(self, step: int) -> float | None:
        for f in self.faults:
            rec = self.fault_records.get(f.index)
            if rec and rec.step == step:
                return rec.t_wall
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
        drills = [res.drill for res in self.faulted if res.drill is not None]
        if self.checkpoint_baseline is not None:  # the same losses, restored from the checkpoint
            same = [
                r["downtime_s"]
                for r in self.checkpoint_baseline.recoveries()
                if r["policy"] == Policy.CHECKPOINT_RESTORE.value and r["downtime_s"] is not None
            ]
            ckpt = statistics.median(same) if same else None
        else:
            ckpt = (
                (
                    self.outage_s(det, restart=False)
                    + max(d.t_end_wall for d in drills)
                    - min(d.t_start_wall for d in drills)
                )
                if drills
                else None
            )
        cold = None
        if self.cold and self.cold_launch_wall is not None:
            caught_up = max(self._caught_up(r) for r in self.cold)
            cold = self.outage_s(det, restart=True) + caught_up - self.cold_launch_wall
        peer = [
            r["downtime_s"] for r in recs if r["policy"] == Policy.PEER_RESTORE.value and r["downtime_s"] is not None
        ]
        excise = [r["downtime_s"] for r in recs if r["policy"] == Policy.EXCISE.value and r["downtime_s"] is not None]
        return {
            Policy.IN_MEMORY.value: statistics.median(mem) if mem else None,
            Policy.PEER_RESTORE.value: statistics.median(peer) if peer else None,
            Policy.EXCISE.value: statistics.median(excise) if excise else None,
            Policy.CHECKPOINT_RESTORE.value: ckpt,
            Policy.COLD_RESTART.value: cold,
        }

    def _caught_up(self, cold: RankOutcome) -> float:
        """When a cold-restarted rank had replayed :attr:`cold_replays` steps (its loop's end when
        that is None): its checkpoint loaded, then that many of its measured steps."""
        if self.cold_replays is None or cold.t_loaded_wall is None:
            return cold.t_caught_up_wall
        return cold.t_loaded_wall + sum(cold.step_s[: self.cold_replays])

    def checkpoint_replays(self) -> int | None:
        """Steps the checkpoint-restore baseline replayed (the median over its restores)."""
        if self.checkpoint_baseline is not None:
            lost = [
                r["lost_steps"]
                for r in self.checkpoint_baseline.recoveries()
                if r["policy"] == Policy.CHECKPOINT_RESTORE.value
            ]
            return int(statistics.median(lost)) if lost else None
        drills = [res.drill for res in self.faulted if res.drill is not None]
        return drills[0].lost_steps if drills else None

    def downtime_includes(self) -> dict[str, str | None]:
        """What each figure of :meth:`downtime` covers, per policy (None where there is no figure):
        beside each other they compare like with like only where they lose the same process."""
        down = self.downtime()
        kind = self.config.fault_kind
        start = self.replacement_start.value
        lost = "the lost rank" if kind is FaultKind.SILENT else "the killed rank"
        replays = self.checkpoint_replays()
        replay = f"the replay of {replays} lost step(s)" if replays is not None else "the replay of the lost steps"
        cleared = {
            FaultKind.PARTITION: "detection or the data link back up, whichever is later",
            FaultKind.STALL: "detection or the stalled rank awake, whichever is later",
        }.get(kind, "detection")
        texts = {
            Policy.IN_MEMORY.value: "detection, consensus, new communicators, rebinding, the first collective; "
            "no process lost, no state moved",
            Policy.PEER_RESTORE.value: f"detection, {lost}'s replacement ({start}), consensus, new communicators, "
            "its state from a peer's copy, the first collective",
            Policy.EXCISE.value: f"detection, consensus, the survivors' new communicators and re-sharded state, the "
            f"first collective; {lost} is not replaced",
            Policy.CHECKPOINT_RESTORE.value: (
                f"the same loss as peer restore: detection, {lost}'s replacement ({start}), consensus, new "
                f"communicators, every rank reloading the last checkpoint, {replay}"
                if self.checkpoint_baseline is not None
                else f"{cleared}, then a restore in the same job with no process lost: consensus, new communicators, "
                f"every rank reloading the last checkpoint, {replay}"
            ),
            Policy.COLD_RESTART.value: f"{cleared if kind is not FaultKind.STALL else 'detection'}, every rank's "
            f"process started anew (fresh interpreters), the checkpoint loaded, {replay}",
        }
        return {policy: (texts[policy] if down[policy] is not None else None) for policy in down}

    def storage_bytes_read(self) -> int:
        """Checkpoint bytes read by the faulted run's recoveries (the drill and cold restart apart)."""
        return sum(o.storage_bytes_read for o in self.faulted)

    def peer_copy_stats(self) -> Any:
        """What the peer copies cost, in async checkpointing's terms
        (:class:`~meshpact.live.recovery.checkpoint.AsyncCheckpointStats`): median step without
        (the fault-free reference, when it ran in this trial) and with copies, the most host
        memory one rank held (own snapshots plus the copies it holds), bytes the whole job ships
        per step, and the mean shipping time; None without peer copies."""
        from ..recovery.checkpoint import AsyncCheckpointStats

        reports = [o.peer for o in self.faulted if o.peer is not None and o.peer.commits]
        if not reports:
            return None
        with_ = [s for o in self.faulted for s in o.step_s]
        without = [s for o in self.reference for s in o.step_s]
        commits = max(p.commits for p in reports)
        return AsyncCheckpointStats(
            steps=commits,
            step_s_without=statistics.median(without) if without else 0.0,
            step_s_with=statistics.median(with_) if with_ else 0.0,
            host_bytes=max(p.host_bytes_peak for p in reports),
            bytes_per_step=int(sum(p.bytes_sent / p.commits for p in reports)),
            write_s_mean=statistics.mean(p.ship_s / p.commits for p in reports),
        )

    def peer_copy_overhead(self) -> JsonObject | None:
        """The ``--json`` view of :meth:`peer_copy_stats`."""
        stats = self.peer_copy_stats()
        if stats is None:
            return None
        reports = [o.peer for o in self.faulted if o.peer is not None and o.peer.commits]
        return {
            "copies": self.config.peer_copies,
            "step_latency": stats.overhead if stats.step_s_without else None,
            "step_ms_without": stats.step_s_without * 1e3 or None,
            "step_ms_with": stats.step_s_with * 1e3,
            "snapshot_ms_per_commit": 1e3 * statistics.mean(p.snapshot_s / p.commits for p in reports),
            "host_bytes_per_rank": stats.host_bytes,
            "network_bytes_per_step": stats.bytes_per_step,
            "network_bytes_per_hour": stats.bytes_per_hour,
            "ship_ms_mean": stats.write_s_mean * 1e3,
            "copies_failed": sum(p.failed for p in reports),
            **_copy_rates(reports),
        }

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
        return sum(1 for rec in self.fault_records.values() if rec.step in steps)

    def old_group_ops_after_rebind(self) -> int:
        """Operations the retired groups received after their rebind: the backend's own sequence
        number over the step that followed the rebind, plus the dispatcher-level count when
        that counter is on."""
        return sum((r.seq_ops_after or 0) + (r.dispatch_ops_after or 0) for res in self.faulted for r in res.retired)

    def summary(self) -> JsonObject:
        recs = self.recoveries()
        rebind = sorted(r["rebind_s"] * 1e3 for r in recs)
        down = self.downtime()
        return {
            "ranks": self.config.ranks,
            "steps": self.config.steps,
            "fault_kind": self.config.fault_kind.value,
            "faults_injected": len(self.fault_records),
            "faults_recovered": self.faults_recovered(),
            "bit_identical": self.bit_identical,
            "policy_counts": self.policy_counts(),
            "rebind_ms": {
                "median": statistics.median(rebind) if rebind else None,
                "max": max(rebind) if rebind else None,
            },
            "rebind_cpu_ms": _median_max([r["rebind_cpu_s"] * 1e3 for r in recs]),
            "recovery_cpu_ms": _median_max([r["cpu_s"] * 1e3 for r in recs]),
            "downtime_s": {
                "in_memory": down["in_memory"],
                "peer_restore": down["peer_restore"],
                "excise": down["excise"],
                "checkpoint_restore": down["checkpoint_restore"],
                "cold_restart": down["cold_restart"],
            },
            "downtime_includes": self.downtime_includes(),
            "storage_bytes_read": self.storage_bytes_read(),
            "final_world_size": len(self.faulted),
            "peer_copy_overhead": self.peer_copy_overhead(),
            "excision": self.excision.view() if self.excision is not None else None,
            "recording": self.recording,
            "recovery_ms": {
                "median": statistics.median([r["recovery_s"] * 1e3 for r in recs]) if recs else None,
                "max": max([r["recovery_s"] * 1e3 for r in recs], default=None),
            },
            "old_group_ops_after_rebind": self.old_group_ops_after_rebind(),
            "retired_groups_still_referenced": sum(r.alive for res in self.faulted for r in res.retired),
            "replacement_processes": self.replacements,
            "mismatches": self.mismatches[:5],
        }


def _median_max(values: list[float]) -> JsonObject:
    return {"median": statistics.median(values) if values else None, "max": max(values, default=None)}


def _copy_rates(reports: list[Any]) -> JsonObject:
    """What the simulator's peer-copy model is calibrated from, per commit and rank (means over
    ranks): the host copy's seconds, the CPU seconds of the ship and of receiving other ranks'
    copies, the wait for a copy in flight, the step's own CPU seconds, and the cores per rank
    this job had: the host's cores less what other processes kept busy meanwhile (the host's
    busy seconds less the ranks' own, per second; ``external_cores``), never fewer than the
    ranks used (see ``peers.PeerCopyCounters``)."""
    from ..recovery.peers import step_cpu_s

    timed = [p for p in reports if p.cycles]
    if not timed:
        return {}

    return {
        "host_copy_ms_per_commit": 1e3 * statistics.mean(p.host_copy_s / p.commits for p in timed),
        "wait_ms_per_commit": 1e3 * statistics.mean(p.wait_s / p.commits for p in timed),
        "ship_cpu_ms_per_commit": 1e3 * statistics.mean(p.ship_cpu_s / p.commits for p in timed),
        "receive_cpu_ms_per_commit": 1e3 * statistics.mean(p.recv_cpu_s / p.commits for p in timed),
        "step_cpu_ms": 1e3 * statistics.mean(step_cpu_s(p) for p in timed),
        **_cores_available(timed),
    }


def _cores_available(timed: list[Any]) -> JsonObject:
    """The host's cores, what other processes kept busy, and the cores per rank left to this job."""
    cores = max(p.cores for p in timed)  # every rank of a trial runs on this host
    if not cores or not all(p.host_busy_s > 0 and p.cycle_s > 0 for p in timed):
        return {"cores_per_rank": min(p.cores_per_rank for p in timed)}  # no host counters: the host's share
    ours = sum(p.cycle_cpu_s / p.cycle_s for p in timed)
    external = max(statistics.mean(p.host_busy_s / p.cycle_s for p in timed) - ours, 0.0)
    return {"host_cores": cores, "external_cores": external, "cores_per_rank": max(cores - external, ours) / len(timed)}


def recovery_span(records: list[dict[str, Any]]) -> tuple[float, float]:
    """The wall-clock span of one recovery over every rank's record: from the moment the first
    rank knew of the fault to the moment the last rank completed the first collective on the
    new group (and any replay). Detection (the fault's injection to the first rank knowing) is
    outside it and reported on its own."""
    if not records:
        raise ValueError("a recovery span needs at least one rank's record")
    return min(r["t_detect_wall"] for r in records), max(r["t_resumed_wall"] for r in records)


def heard_spread_ms(events: list[Event]) -> list[float]:
    """Per recovery (each generation's fault, in order), the first rank knowing of the fault -> the
    last rank's process hearing of it, in ms, from every rank's ``detected`` event. A rank whose
    heartbeat raised the alarm (a peer's ``recovering`` key heard by its listener, or its own
    watch) heard then, and its data path was cut then; its training thread may raise later, once
    it leaves the computation it was in or gets a core (the ``detected`` event's
    ``heartbeat_alarm_to_severed_ms`` and ``heartbeat_severed_to_raised_ms`` say how long). A rank
    with no alarm heard when its step raised. The knowing spread (``knew_spread_s`` of
    :meth:`TrialResult.recoveries`) counts that wait; this does not."""
    heard: dict[tuple[int, int], list[float]] = {}
    for ev in events:
        if ev.event != EventKind.DETECTED:
            continue
        d = ev.data
        t = ev.t - float(d.get("seconds", 0.0))  # detect() began: the step raised
        if d.get("heartbeat_alarm") and "heartbeat_severed_to_raised_ms" in d:
            t = min(
                t, ev.t - (float(d["heartbeat_severed_to_raised_ms"]) + float(d["heartbeat_alarm_to_severed_ms"])) / 1e3
            )
        heard.setdefault((int(d.get("generation", 0)), int(d.get("step", -1))), []).append(t)
    return [(max(ts) - min(ts)) * 1e3 for _, ts in sorted(heard.items()) if len(ts) > 1]


def compare_final(a_dir: Path, b_dir: Path, ranks: int) -> list[str]:
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
