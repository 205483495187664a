"""Benchmark: in-memory recovery against checkpoint restore, cold restart and torchft.

Its headline, ``fault_to_running_ms_p50_by_kind``: per fault kind, the downtime a user sees, from
the fault to every rank running the next step (detection included), over the 4-rank trials the
sections below run (``collective``: the side-by-side runs at the first timeout and the baselines'
run; ``kill``: peer restore; ``kill_excised``; ``stall``). ``bench/scale.py`` reports the same at
the tiny decoder and at ``gpt100m``.

Measures on this machine, in one run:

- rebuild + rebind of the data-path group on the FSDP2 harness at 2, 4 and 8 ranks
  (``rebind_ms_by_ranks``: rebinding alone, and its flatness max/min; ``rebuild_ms_by_ranks``:
  the new group);
- side by side, interleaved in one run (:func:`side_by_side`): meshpact's in-memory recovery
  of ``--recoveries`` raised collectives at 2, 4 and 8 ranks (first rank knowing -> every rank
  through the new group's first collective; the standby swapped in), once per data-path
  timeout (``--timeouts``, 1 s and 30 s: ``recovery_ms_max_by_timeout``), and torchft 0.2.0's
  ``configure`` + first allreduce of a gloo group at the same sizes (the peer; the optional
  ``bench`` extra, ``pip install 'meshpact[bench]'``): p50, p99, max and the ratio per size
  (``recovery_ms_p50``/``_p99``/``_max`` are the 4-rank numbers at the first timeout); each
  recovery's CPU, every rank's process summed, by pipeline step (``cpu_ms_by_stage_p50``,
  ``cpu_ms_all_ranks_p50``) and each rank's own by step (``cpu_ms_by_rank_by_stage_p50``: where
  each rank's CPU goes, read from its process CPU clock, so load matters less than in wall
  time) beside torchft's configure + first allreduce measured the same way in the same run
  (``cpu_ratio_p50_vs_torchft``: a shared machine's speed moves both), and every recovery
  over 100 ms with how its last rank learned of
  the fault (``over_100_ms``);
- ``--baseline-faults`` raised collectives on 4 ranks with downtime per fault against a
  checkpoint restore in the job and a cold restart measured in the same run (ratios);
- per-update asynchronous checkpointing: step-latency overhead, host memory, storage/hour;
- what a commit adds to a step (``commit_overhead_ms_by_state_mb``): the commit check (O(1)
  bytes hashed) and the capture of every generator, for 1 MB to 1 GB of local state (float32
  tensors of at most 4 MB, as a sharded model's are), beside a full digest of the same state.

Prints a table for people and one JSON line (the last line) for machines.
- stalled ranks found by the heartbeat under a 30 s data-path timeout
  (``stall_detect_ms_p50``: injection to the first rank knowing), and cut data links found
  by its quiet-data-path rule under the same timeout (``partition_detect_ms_p50``; network
  namespaces needed).
- peer copies (``peer_copy``, beside ``async_checkpoint``): the step-latency overhead measured
  by fault-free trials with one peer copy per rank and with none, interleaved (K=1, K=0, ...:
  both meet the same load), beside the simulator's model calibrated from each K=1 trial's own
  summary (host copy, ship and step CPU seconds, bytes, cores; never its step latency) and its
  error (``peer_copy.model``); killed ranks restored from a peer's host memory against the same
  kills restored from the checkpoint (two runs, K=1 and K=0): host bytes per rank, network
  bytes per hour, and downtime per kill;
  beside them the same kills excised (a third run, ``--on-rank-loss excise``, at most 3 kills
  at 4 ranks): downtime per excision and the largest difference from the never-failed run.

- with ``--false-alarm-minutes M``: only a fault-free run of M minutes on 4 ranks at the
  default settings, counting recoveries and heartbeat alarms (``false_alarms``).

Usage: ``python bench/recovery.py [--recoveries 100] [--timeouts 1,30] [--ranks 2,4,8] [--quick] [--commit-only] [--stall-only] [--peer-only]
[--side-by-side-only] [--rebind-only] [--false-alarm-minutes M]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Mapping

from meshpact.live.launch.launcher import host_store, launch
from meshpact.live.recovery.faults import FaultKind
from meshpact.live.trials.trial import TrialConfig, run_trial
from _results import FAULT_TO_RUNNING, emit, p50_by_kind


def _probe(target: str, ranks: int, args: dict[str, Any]) -> list[dict[str, Any]]:
    control = host_store("127.0.0.1", 0, ranks)
    results = launch(
        target,
        ranks,
        args,
        timeout_s=600,
        env=lambda r: {"MESHPACT_CONTROL_ADDR": "127.0.0.1", "MESHPACT_CONTROL_PORT": str(control.port)},
    )
    return [r.value for r in results]


def _downtime(out: dict[str, Any], kind: str, result: Any, policy: str) -> None:
    """Add ``result``'s recoveries of ``policy`` to fault kind ``kind``'s downtime as users see it
    (fault -> every rank running the next step, :data:`FAULT_TO_RUNNING`, written by :func:`_report`)."""
    out.setdefault("fault_to_running_ms_by_kind", {}).setdefault(kind, []).extend(result.fault_to_running_ms(policy))


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def commit_overhead(
    sizes_mb: tuple[int, ...] = (1, 10, 100, 1000), repeats: int = 20
) -> tuple[dict[int, float], dict[int, float]]:
    """Median ms of one commit (commit check + generators) and of one full digest, by state MB."""
    import torch

    from meshpact.live.recovery.state import capture_rng, commit_check, digest

    commit, full = {}, {}
    chunk = 1 << 20  # float32 elements: 4 MB
    for mb in sizes_mb:
        n = mb * (1 << 18)  # float32 elements in mb MB
        state = {f"param/{i}": torch.randn(min(chunk, n - i * chunk)) for i in range((n + chunk - 1) // chunk)}
        times = []
        for step in range(repeats):
            t0 = time.perf_counter()
            commit_check(step, state)
            capture_rng()
            times.append((time.perf_counter() - t0) * 1e3)
        commit[mb] = statistics.median(times)
        t0 = time.perf_counter()
        digest(state)
        full[mb] = (time.perf_counter() - t0) * 1e3
        del state
    return commit, full


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--recoveries",
        type=int,
        default=100,
        help="raised-collective recoveries side by side, per size and data-path timeout",
    )
    ap.add_argument(
        "--timeouts",
        default="1,30",
        metavar="S,S",
        help="data-path timeouts (seconds) of the side-by-side runs; the first is the headline",
    )
    ap.add_argument("--ranks", default="2,4,8", metavar="N,N", help="sizes of the side-by-side runs")
    ap.add_argument("--quick", action="store_true", help="fewer rounds (a smoke run, not the numbers)")
    ap.add_argument("--commit-only", action="store_true", help="only the commit overhead by state size")
    ap.add_argument("--stall-only", action="store_true", help="only stall and cut-link detection by heartbeat")
    ap.add_argument("--peer-only", action="store_true", help="only peer copies against checkpoint restore")
    ap.add_argument(
        "--side-by-side-only",
        action="store_true",
        help="only meshpact against torchft, 2/4/8 ranks (with --rebind-only: both)",
    )
    ap.add_argument(
        "--rebind-only",
        action="store_true",
        help="only rebuild + rebind by ranks (2/4/8) and flatness (with --side-by-side-only: both)",
    )
    ap.add_argument(
        "--baseline-faults",
        type=int,
        default=20,
        help="faults of the 4-rank run with the checkpoint-restore and cold-restart baselines",
    )
    ap.add_argument(
        "--false-alarm-minutes",
        type=float,
        default=None,
        metavar="M",
        help="only a fault-free run of M minutes on 4 ranks at the default settings",
    )
    ap.add_argument(
        "--results-dir",
        default=None,
        metavar="DIR",
        help="write recovery.json there instead of bench/results/ (a reduced run that must not "
        "replace the published numbers)",
    )
    ns = ap.parse_args(argv)
    if ns.recoveries < 1 or ns.baseline_faults < 1:
        ap.error(f"--recoveries and --baseline-faults must be at least 1, got {ns.recoveries} and {ns.baseline_faults}")
    try:
        timeouts = tuple(float(x) for x in ns.timeouts.split(","))
        sizes = tuple(int(x) for x in ns.ranks.split(","))
    except ValueError:
        ap.error(
            f"--timeouts takes seconds and --ranks whole numbers, comma-separated (1,30 and 2,4,8), got "
            f"{ns.timeouts!r} and {ns.ranks!r}"
        )
    if not all(t > 0 for t in timeouts) or not all(n >= 2 for n in sizes):
        ap.error(f"--timeouts must be positive and --ranks at least 2, got {ns.timeouts!r} and {ns.ranks!r}")
    if ns.false_alarm_minutes is not None and not 0 < ns.false_alarm_minutes <= 120:
        ap.error(f"--false-alarm-minutes must be more than 0 and at most 120, got {ns.false_alarm_minutes}")
    rounds = 2 if ns.quick else 6
    out: dict[str, Any] = {
        "machine": {
            "cpus": os.cpu_count(),
            "load_avg_1m_at_start": round(os.getloadavg()[0], 2),
            "backend": "gloo on loopback",
        }
    }
    rows: list[tuple[str, str]] = []

    if ns.false_alarm_minutes is not None:
        rows += false_alarms(out, ns.false_alarm_minutes)
        _report(rows, out, ns.results_dir)
        return 0
    if ns.side_by_side_only or ns.rebind_only:  # either, or both in one run and one JSON line
        if ns.rebind_only:
            rows += rebinding(out, rounds)
        if ns.side_by_side_only:
            rows += side_by_side(
                out, min(ns.recoveries, 5) if ns.quick else ns.recoveries, 1 if ns.quick else 2, timeouts, sizes
            )
        _report(rows, out, ns.results_dir)
        return 0
    if ns.stall_only:
        rows += stall_detection(out, 3 if ns.quick else 10)
        _report(rows, out, ns.results_dir)
        return 0
    if ns.peer_only:
        rows += peer_copies(out, 1 if ns.quick else 3)
        _report(rows, out, ns.results_dir)
        return 0

    commit, full = commit_overhead((1, 10, 100) if ns.quick else (1, 10, 100, 1000))
    out["commit_overhead_ms_by_state_mb"] = commit
    out["full_digest_ms_by_state_mb"] = full
    for mb in commit:
        rows.append(
            (f"commit overhead, {mb} MB of state (ms; a full digest instead)", f"{commit[mb]:.3f} ({full[mb]:.1f})")
        )
    if ns.commit_only:
        _report(rows, out, ns.results_dir)
        return 0

    rows += rebinding(out, rounds)
    rows += side_by_side(
        out, min(ns.recoveries, 5) if ns.quick else ns.recoveries, 1 if ns.quick else 2, timeouts, sizes
    )
    rows += baselines(out, ns)
    _report(rows, out, ns.results_dir)
    return 0


def rebinding(out: dict[str, Any], rounds: int) -> list[tuple[str, str]]:
    """Rebuild + rebind of the data-path group on the FSDP2 harness at 2, 4 and 8 ranks."""
    rows: list[tuple[str, str]] = []
    rebind_by, rebuild_by, first_by = {}, {}, {}
    for ranks in (2, 4, 8):
        vals = _probe("meshpact.live.trials.probe:rebind_probe", ranks, {"rounds": rounds})
        rebind = [x for v in vals for x in v["rebind_ms"]]
        build = [x for v in vals for x in v["build_ms"]]
        first = [x for v in vals for x in v["first_op_ms"]]
        rebind_by[ranks] = statistics.median(rebind)
        rebuild_by[ranks] = statistics.median(build)
        first_by[ranks] = statistics.median(first)
        rows.append((f"rebind, {ranks} ranks (ms, median / max)", f"{rebind_by[ranks]:.3f} / {max(rebind):.3f}"))
        rows.append(
            (
                f"rebuild group + first collective, {ranks} ranks (ms, median)",
                f"{rebuild_by[ranks]:.1f} + {first_by[ranks]:.1f}",
            )
        )
        out["reconfigure_available"] = vals[0]["reconfigure_available"]
    out["rebind_ms_by_ranks"] = rebind_by
    out["rebuild_ms_by_ranks"] = rebuild_by
    out["first_collective_ms_by_ranks"] = first_by
    rows.append(
        (
            "ProcessGroup.reconfigure in this torch",
            "yes" if out["reconfigure_available"] else "no (torch < 2.14): rebuild + rebind path measured",
        )
    )

    out["rebind_flatness_max_over_min"] = max(rebind_by.values()) / min(rebind_by.values())
    rows.append(
        ("rebind flatness over 2-8 ranks (max / min of the medians)", f"{out['rebind_flatness_max_over_min']:.2f}")
    )
    return rows


def baselines(out: dict[str, Any], ns: argparse.Namespace) -> list[tuple[str, str]]:
    """Raised collectives on 4 ranks against the checkpoint-restore and cold-restart baselines
    of the same run, async checkpointing's cost, peer copies and stall detection."""
    rows: list[tuple[str, str]] = []
    n = max(1, ns.baseline_faults if not ns.quick else min(ns.baseline_faults, 5))
    t0 = time.time()
    result = run_trial(
        TrialConfig(ranks=4, steps=n + 10, faults=n, fault_kind=FaultKind.COLLECTIVE, checkpoint_every=10)
    )
    # the launcher deadline is derived (RecoveryConfig.launcher_deadline_s) from steps and faults
    summary = result.summary()
    _downtime(out, "collective", result, "in_memory")
    recs = [r for r in result.recoveries() if r["policy"] == "in_memory"]
    rec_ms = [r["recovery_s"] * 1e3 for r in recs]
    det_ms = [r["detection_s"] * 1e3 for r in recs]
    down = summary["downtime_s"]
    out.update(
        {
            "baseline_recoveries": len(recs),
            "bit_identical": summary["bit_identical"] and out.get("bit_identical", True),
            "baseline_recovery_ms_p50": statistics.median(rec_ms),
            "detection_ms_p50": statistics.median(det_ms),
            "downtime_s": down,
            "downtime_ratio_checkpoint_restore": (
                down["checkpoint_restore"] / down["in_memory"]
                if down["in_memory"] and down["checkpoint_restore"]
                else None
            ),
            "downtime_ratio_cold_restart": (
                down["cold_restart"] / down["in_memory"] if down["in_memory"] and down["cold_restart"] else None
            ),
            "checkpoint_restore_lost_steps": result.faulted[0].drill.lost_steps if result.faulted[0].drill else None,
            "old_group_ops_after_rebind": summary["old_group_ops_after_rebind"],
            "trial_wall_s": time.time() - t0,
        }
    )
    rows += [
        (
            f"in-memory recovery, 4 ranks, {len(recs)} raised collectives with the baselines (ms, p50)",
            f"{out['baseline_recovery_ms_p50']:.1f}",
        ),
        ("detection, injection -> first rank knowing (ms, p50)", f"{out['detection_ms_p50']:.1f}"),
        (
            "downtime per fault: in memory / checkpoint restore / cold restart (s)",
            " / ".join(
                "-" if down[k] is None else f"{down[k]:.3f}"
                for k in ("in_memory", "checkpoint_restore", "cold_restart")
            ),
        ),
        (
            "downtime ratio vs in memory: checkpoint restore / cold restart",
            f"{out['downtime_ratio_checkpoint_restore'] or 0:.1f}x / {out['downtime_ratio_cold_restart'] or 0:.1f}x",
        ),
        (
            "bit-identical to the fault-free run; ops on retired groups",
            f"{summary['bit_identical']}; {summary['old_group_ops_after_rebind']}",
        ),
    ]

    ck = _probe("meshpact.live.trials.probe:checkpoint_probe", 4, {"steps": 8 if ns.quick else 30})
    step_without = statistics.median(v["step_ms_without"] for v in ck)
    step_with = statistics.median(v["step_ms_with"] for v in ck)
    file_bytes_per_step = sum(v["file_bytes_written"] for v in ck) / ck[0]["steps"]
    out["async_checkpoint"] = {
        "step_ms_without": step_without,
        "step_ms_with": step_with,
        "overhead": step_with / step_without - 1.0,
        "host_bytes": sum(v["host_bytes"] for v in ck),
        "storage_bytes_per_hour": file_bytes_per_step * 3600.0 / (step_with / 1e3),
    }
    a = out["async_checkpoint"]
    rows += [
        (
            "async checkpoint every update: step ms without / with (overhead)",
            f"{step_without:.1f} / {step_with:.1f} ({a['overhead'] * 100:+.1f}%)",
        ),
        (
            "async checkpoint: host memory (all ranks) / storage per hour",
            f"{a['host_bytes'] / 1e6:.2f} MB / {a['storage_bytes_per_hour'] / 1e9:.1f} GB",
        ),
    ]

    rows += peer_copies(out, 1 if ns.quick else 3)
    rows += stall_detection(out, 3 if ns.quick else 10)
    return rows


def peer_copies(out: dict[str, Any], kills: int) -> list[tuple[str, str]]:
    """``kills`` SIGKILLed ranks at 4 ranks, twice: with one peer copy per rank (each
    replacement fetches from a holder) and with none (each kill reloads the checkpoint on
    every rank). Downtime per kill is the fault's injection to every rank through the new
    group's first collective and the replay, replacement process start included in both."""
    runs = {}
    for k in (1, 0):
        runs[k] = run_trial(
            TrialConfig(
                ranks=4,
                steps=16,
                faults=kills,
                fault_kind=FaultKind.KILL,
                checkpoint_every=4,
                peer_copies=k,
                baselines=(k == 1),
            )
        )
    peer, ckpt = runs[1], runs[0]
    excised = run_trial(
        TrialConfig(
            ranks=4,
            steps=16,
            faults=min(kills, 3),
            fault_kind=FaultKind.KILL,
            checkpoint_every=4,
            peer_copies=1,
            baselines=False,
            on_rank_loss="excise",
        )
    )
    _downtime(out, "kill", peer, "peer_restore")
    _downtime(out, "kill_excised", excised, "excise")
    excision = excised.excision

    def per_kill(result: Any, policy: str) -> float | None:
        vals = [r["downtime_s"] for r in result.recoveries() if r["policy"] == policy and r["downtime_s"] is not None]
        return statistics.median(vals) if vals else None

    stats = peer.peer_copy_stats()
    baseline = peer.downtime()
    judged = overhead_interleaved(3)
    out["peer_copy"] = {
        "overhead": judged["overhead"],
        "step_ms_without": judged["step_ms_without"],
        "step_ms_with": judged["step_ms_with"],
        "model": judged,
        "host_bytes_per_rank": stats.host_bytes if stats else None,
        "network_bytes_per_hour": stats.bytes_per_hour if stats else None,
        "kills": kills,
        "bit_identical": peer.bit_identical and ckpt.bit_identical,
        "policy_counts_k1": peer.policy_counts(),
        "policy_counts_k0": ckpt.policy_counts(),
        "storage_bytes_read_k1": peer.storage_bytes_read(),
        "storage_bytes_read_k0": ckpt.storage_bytes_read(),
    }
    out["downtime_per_kill_s"] = {
        "peer_restore": per_kill(peer, "peer_restore"),
        "checkpoint_restore": per_kill(ckpt, "checkpoint_restore"),
        # the K=1 run's own baseline: the same kills, the same replacement
        # processes started, restored from the checkpoint instead of the peers
        "checkpoint_restore_same_kills": baseline["checkpoint_restore"],
        "cold_restart": baseline["cold_restart"],
        "excise": per_kill(excised, "excise"),
    }
    out["excision"] = {
        "kills": min(kills, 3),
        "final_world_size": len(excised.faulted),
        "equal_to_excising_reference": excision.equal_to_excising_reference if excision else None,
        "max_abs_diff_from_unfailed": excision.max_abs_diff_from_unfailed if excision else None,
    }
    p, d = out["peer_copy"], out["downtime_per_kill_s"]

    def f(x: float | None, fmt: str = ".2f") -> str:
        return "-" if x is None else format(x, fmt)

    m = judged
    return [
        (
            f"peer copy (K=1) every update, {m['pairs']} fault-free trials each with K=1 and K=0 interleaved: "
            "step ms without / with (overhead)",
            f"{f(p['step_ms_without'], '.1f')} / {f(p['step_ms_with'], '.1f')} "
            f"({'-' if p['overhead'] is None else format(p['overhead'] * 100, '+.1f')}%)",
        ),
        (
            "  model calibrated from each K=1 trial's copy rates: predicted / measured ms per step (error)",
            f"{m['predicted_ms_per_step']:.1f} / {m['measured_ms_per_step']:.1f} "
            f"({'-' if m['error'] is None else format(m['error'] * 100, '+.1f')}%)",
        ),
        (
            "  its inputs: host copy / ship / receive / step CPU ms per commit; cores per rank (other jobs' cores of "
            "the host's); load average 1 min",
            f"{m['host_copy_ms']:.2f} / {m['ship_cpu_ms']:.1f} / {m['receive_cpu_ms']:.1f} / {m['step_cpu_ms']:.1f}; "
            f"{m['cores_per_rank']:.2f} ({m['external_cores']:.2f} of {m['host_cores']}); "
            f"{m['load_avg_1m'][0]:.2f} -> {m['load_avg_1m'][1]:.2f}",
        ),
        (
            "peer copy: host memory per rank / network per hour (whole job)",
            f"{(p['host_bytes_per_rank'] or 0) / 1e6:.2f} MB / {(p['network_bytes_per_hour'] or 0) / 1e9:.1f} GB",
        ),
        (
            f"downtime per kill, {kills} kills at 4 ranks: peer restore / checkpoint restore (s)",
            f"{f(d['peer_restore'])} / {f(d['checkpoint_restore'])}",
        ),
        (
            "  baselines of the K=1 run: the same kills restored from the checkpoint (replacements started the same "
            "way) / cold restart (s)",
            f"{f(d['checkpoint_restore_same_kills'])} / {f(d['cold_restart'])}",
        ),
        (
            f"downtime per excision, {out['excision']['kills']} kills at 4 ranks -> "
            f"{out['excision']['final_world_size']} (s); equal to the excising reference; max |diff| from never-failed",
            f"{f(d['excise'])}; {out['excision']['equal_to_excising_reference']}; "
            f"{f(out['excision']['max_abs_diff_from_unfailed'], '.2g')}",
        ),
        (
            "storage read by recoveries: peer / checkpoint (bytes); bit-identical",
            f"{p['storage_bytes_read_k1']} / {p['storage_bytes_read_k0']}; {p['bit_identical']}",
        ),
    ]


def overhead_interleaved(pairs: int, steps: int = 24) -> dict[str, Any]:
    """The step-latency overhead of one peer copy per rank, measured honestly: ``pairs``
    fault-free trials at 4 ranks with K=1 and with K=0, interleaved so both meet the same load
    (each trial runs twice: its reference and its faulted run, both with the same K). The
    overhead is the median step with copies less the median without. Beside it, the
    simulator's model calibrated from each K=1 trial's summary alone (host copy, ship and
    step CPU seconds, bytes, cores per rank: :func:`~meshpact.simulator.calibrate.peer_copy_calibration`)
    predicts the stretch of the measured step without copies; the median prediction is
    reported with its error."""
    from meshpact.simulator.calibrate import peer_copy_calibration

    load0 = os.getloadavg()[0]
    steps_by_k: dict[int, list[float]] = {1: [], 0: []}
    calibrations = []
    external: list[float] = []
    for _ in range(pairs):
        for k in (1, 0):
            result = run_trial(
                TrialConfig(
                    ranks=4,
                    steps=steps,
                    faults=0,
                    fault_kind=FaultKind.KILL,
                    checkpoint_every=steps,
                    peer_copies=k,
                    baselines=False,
                )
            )
            # the first step of a run builds and warms up: left out
            steps_by_k[k] += [s for o in result.reference + result.faulted for s in o.step_s[1:]]
            if k == 1:
                summary = result.summary()
                cal = peer_copy_calibration(summary["peer_copy_overhead"], summary["final_world_size"])
                external.append(summary["peer_copy_overhead"].get("external_cores", float("nan")))
                if cal is not None:
                    calibrations.append(cal)
    without, with_ = statistics.median(steps_by_k[0]), statistics.median(steps_by_k[1])
    predicted = statistics.median(c.judge(without, with_).predicted_s_per_step for c in calibrations)
    measured = with_ - without
    ms = [c.measured for c in calibrations]
    return {
        "pairs": pairs,
        "steps": steps,
        "ranks": 4,
        "step_ms_without": without * 1e3,
        "step_ms_with": with_ * 1e3,
        "overhead": measured / without,
        "measured_ms_per_step": measured * 1e3,
        "predicted_ms_per_step": predicted * 1e3,
        "error": predicted / measured - 1.0 if measured > 0 else None,
        "cpu_bound": [c.cost(without).cpu_bound for c in calibrations],
        "host_copy_ms": 1e3 * statistics.median(m.host_copy_s or 0.0 for m in ms),
        "ship_cpu_ms": 1e3 * statistics.median(m.ship_cpu_s or 0.0 for m in ms),
        "receive_cpu_ms": 1e3 * statistics.median(m.receive_cpu_s or 0.0 for m in ms),
        "ship_wall_ms": 1e3 * statistics.median(m.ship_s for m in ms),
        "step_cpu_ms": 1e3 * statistics.median(m.step_cpu_s or 0.0 for m in ms),
        "cores_per_rank": statistics.median(m.cores_per_rank or 0.0 for m in ms),
        "external_cores": statistics.median(external),
        "host_cores": os.cpu_count(),
        "bytes_per_commit": statistics.median(m.bytes_per_commit for m in ms),
        "load_avg_1m": [round(load0, 2), round(os.getloadavg()[0], 2)],
    }


STAGES = ("detect", "agree_on", "rebuild", "rebind", "restore", "resume")  # the pipeline's steps, in order
TAIL_MS = 100.0  # a recovery longer than this is listed with how its last rank learned of the fault


def _recovery_cpu(result: Any, generations: set[int]) -> dict[int, dict[str, Any]]:
    """Per recovery (generation): every rank's CPU by pipeline step, summed over the ranks and
    each rank's own (``by_rank``), and the CPU the ranks spent after resuming (left to the job;
    not in the recovery's)."""
    from meshpact.core.recording import EventKind

    out: dict[int, dict[str, Any]] = {}
    for e in result.events():
        gen = e.data.get("generation")
        if e.event != EventKind.RECOVERY_DONE or gen not in generations:
            continue
        row = out.setdefault(
            gen,
            {
                "by_stage": dict.fromkeys(STAGES, 0.0),
                "main_by_stage": dict.fromkeys(STAGES, 0.0),
                "after_resume": 0.0,
                "by_rank": {},
            },
        )
        for stage, sec in (e.data.get("cpu_s_by_stage") or {}).items():
            row["by_stage"][stage] = row["by_stage"].get(stage, 0.0) + sec * 1e3
            row["by_rank"].setdefault(e.rank, {})[stage] = sec * 1e3
        for stage, sec in (e.data.get("thread_cpu_s_by_stage") or {}).items():
            row["main_by_stage"][stage] = row["main_by_stage"].get(stage, 0.0) + sec * 1e3
        row["after_resume"] += e.data.get("after_resume_cpu_s", 0.0) * 1e3
    return out


def _by_rank_p50(spent: list[dict[str, Any]]) -> dict[int, dict[str, float]]:
    """Each rank's CPU by pipeline step (ms), the median over the recoveries (a step a rank did
    not record counts 0), and its total."""
    ranks = sorted({r for c in spent for r in c["by_rank"] if r is not None})
    out: dict[int, dict[str, float]] = {}
    for r in ranks:
        mine = [c["by_rank"].get(r, {}) for c in spent]
        row = {s: round(statistics.median(m.get(s, 0.0) for m in mine), 3) for s in STAGES}
        row["total"] = round(statistics.median(sum(m.values()) for m in mine), 3)
        out[r] = row
    return out


def _tail(result: Any, rec: dict[str, Any]) -> dict[str, Any]:
    """How the last rank to know of a slow recovery's fault learned of it, and when."""
    from meshpact.core.recording import EventKind

    knew = [
        e
        for e in result.events()
        if e.event == EventKind.DETECTED and e.data.get("generation") == rec["generation"] - 1
    ]
    last = max(knew, key=lambda e: e.t, default=None)
    return {
        "generation": rec["generation"],
        "ms": rec["recovery_s"] * 1e3,
        "stages_ms": {k: round(v * 1e3, 1) for k, v in rec["stages_s"].items()},
        "last_rank_knew": None
        if last is None
        else {
            "rank": last.rank,
            "after_first_ms": round((last.t - rec["t_first_knew_wall"]) * 1e3, 1),
            "error": str(last.data.get("error", ""))[:160],
            "heartbeat_alarm": last.data.get("heartbeat_alarm"),
            "heartbeat_failed_looks": last.data.get("heartbeat_failed_looks"),
            **{
                k: last.data[k]
                for k in (
                    "heartbeat_lock_wait_ms",
                    "heartbeat_sever_ms",
                    "heartbeat_alarm_to_severed_ms",
                    "heartbeat_severed_to_raised_ms",
                    "heartbeat_flush_end",
                    "heartbeat_flush_unsent",
                    "heartbeat_flush_unread",
                    "heartbeat_flush_ms",
                    "heartbeat_flush_gap_ms",
                    "heartbeat_flush_wake_ms",
                    "flush_end",
                    "flush_ms",
                    "flush_gap_ms",
                    "flush_wake_ms",
                )
                if k in last.data
            },
        },
    }


def _flush_of(data: Mapping[str, Any]) -> dict[str, Any]:
    """How one rank's sever of a recovery waited for a message under way: its own sever's, or the
    sever its heartbeat made when a peer's recovery was heard (that one cut the step short)."""
    if data.get("heartbeat_flush_end"):
        return {
            "end": data["heartbeat_flush_end"],
            "ms": data.get("heartbeat_flush_ms", 0.0),
            "gap_ms": data.get("heartbeat_flush_gap_ms", 0.0),
            "wake_ms": data.get("heartbeat_flush_wake_ms", 0.0),
        }
    return {
        "end": data.get("flush_end") or "no wait",
        "ms": data.get("flush_ms", 0.0),
        "gap_ms": data.get("flush_gap_ms", 0.0),
        "wake_ms": data.get("flush_wake_ms", 0.0),
    }


def _flush_summary(flushes: list[dict[str, Any]]) -> dict[str, Any]:
    """The severs of every recovery at one size: how many ended each way, and for those that saw a
    message under way and waited for it, the wait's p50 and max and the longest quiet spell between
    two of its movements (what the settle after it must outlast: ``FLUSH_SETTLE_S``; a lower bound), beside
    the longest time the flushing thread itself took between two looks (its own late wake-ups)."""
    ends: dict[str, int] = {}
    for f in flushes:
        ends[f["end"]] = ends.get(f["end"], 0) + 1
    waited = [f for f in flushes if f["end"] in ("settled", "stalled", "most")]
    if not waited:
        return {"by_end": ends}
    return {
        "by_end": ends,
        "waited_ms_p50": statistics.median(f["ms"] for f in waited),
        "waited_ms_max": max(f["ms"] for f in waited),
        "gap_ms_max": max(f["gap_ms"] for f in waited),
        "look_interval_ms_max": max(f.get("wake_ms", 0.0) for f in waited),
    }


def _timeouts_used(result: Any, asked_s: float) -> list[float]:
    """The data-path timeouts the ranks ran with: the one asked for, and any the runtime raised it
    to for the job's measured steps (a step under load may need more)."""
    from meshpact.core.recording import EventKind

    fitted = {float(e.data["seconds"]) for e in result.events() if e.event == EventKind.TIMEOUT_FITTED}
    return sorted({asked_s} | fitted)


def side_by_side(
    out: dict[str, Any],
    faults: int,
    chunks: int,
    timeouts: tuple[float, ...] = (1.0, 30.0),
    sizes: tuple[int, ...] = (2, 4, 8),
) -> list[tuple[str, str]]:
    """meshpact's in-memory recovery and torchft's configure + first allreduce at ``sizes``
    ranks, interleaved (``chunks`` passes over the data-path timeouts and the sizes, ``faults``
    per size and timeout split between them), so both meet the same load. The first timeout's
    figures are the headline (``recovery_ms_by_ranks``); every timeout's are under
    ``recovery_ms_by_timeout`` and ``recovery_ms_max_by_timeout``. Each recovery's CPU is the
    ranks' process CPU from knowing of the fault to resuming, summed over the ranks, by
    pipeline step; what the ranks do after resuming (write the recovery's events, move the
    consensus counters) is ``after_resume_cpu_ms_p50``, apart."""
    cores = os.cpu_count() or 1
    per_chunk = max(1, -(-faults // chunks))
    keys = [(t, n) for t in timeouts for n in sizes]
    ours: dict[tuple[float, int], list[float]] = {k: [] for k in keys}
    cpu: dict[tuple[float, int], list[dict[str, Any]]] = {k: [] for k in keys}
    firsts: dict[tuple[float, int], list[float]] = {k: [] for k in keys}  # each trial's first fault (lands at step 1)
    tails: dict[tuple[float, int], list[dict[str, Any]]] = {k: [] for k in keys}
    used: dict[tuple[float, int], set[float]] = {k: set() for k in keys}
    theirs: dict[int, list[float]] = {n: [] for n in sizes}
    theirs_cpu: dict[int, list[float]] = {n: [] for n in sizes}  # per round: every rank's process CPU, summed
    standby: dict[tuple[float, int], dict[str, int]] = {k: {"used": 0, "built": 0} for k in keys}
    flushes: dict[tuple[float, int], list[dict[str, Any]]] = {k: [] for k in keys}  # every rank's sever of a recovery
    torchft_error: str | None = None
    identical = True
    load = [round(os.getloadavg()[0], 2)]
    from meshpact.core.recording import EventKind

    for _ in range(chunks):
        for t in timeouts:
            for n in sizes:
                result = run_trial(
                    TrialConfig(
                        ranks=n,
                        steps=per_chunk + 6,
                        faults=per_chunk,
                        fault_kind=FaultKind.COLLECTIVE,
                        checkpoint_every=per_chunk + 6,
                        baselines=False,
                        data_timeout_s=t,
                    )
                )
                identical = identical and result.bit_identical
                if t == timeouts[0] and n == (4 if 4 in sizes else sizes[0]):  # the headline's size and timeout
                    _downtime(out, "collective", result, "in_memory")
                told = [r for r in result.recoveries() if r["policy"] == "in_memory"]
                ours[(t, n)] += [r["recovery_s"] * 1e3 for r in told]
                by_gen = _recovery_cpu(result, {r["generation"] for r in told})
                cpu[(t, n)] += [by_gen[r["generation"]] for r in told if r["generation"] in by_gen]
                first = min((r["generation"] for r in told), default=None)
                firsts[(t, n)] += [r["recovery_s"] * 1e3 for r in told if r["generation"] == first]
                tails[(t, n)] += [_tail(result, r) for r in told if r["recovery_s"] * 1e3 > TAIL_MS]
                used[(t, n)].update(_timeouts_used(result, t))
                for e in result.events():
                    if e.event == EventKind.REBUILT and e.rank == 0 and e.data.get("standby"):
                        standby[(t, n)]["used" if e.data["standby"] == "used" else "built"] += 1
                    if e.event == EventKind.DETECTED:
                        flushes[(t, n)].append(_flush_of(e.data))
                if t == timeouts[0] and torchft_error is None:
                    vals = _probe("meshpact.live.trials.probe:torchft_probe", n, {"rounds": per_chunk + 1})
                    if "error" in vals[0]:
                        torchft_error = str(vals[0]["error"])
                    else:  # the first configure creates the group: not a reconfigure
                        theirs[n] += [x for v in vals for x in v["configure_first_op_ms"][1:]]
                        rounds = zip(*(v.get("configure_first_op_cpu_ms", [])[1:] for v in vals))
                        theirs_cpu[n] += [sum(r) for r in rounds]
                load.append(round(os.getloadavg()[0], 2))
    rows: list[tuple[str, str]] = []
    by_timeout: dict[str, dict[int, dict[str, Any]]] = {}
    for t in timeouts:
        label = f"{t:g}s"
        by_ranks: dict[int, dict[str, Any]] = {}
        for n in sizes:
            k = (t, n)
            mine = ours[k]
            later = list(mine)
            for x in firsts[k]:
                later.remove(x)
            spent = cpu[k]
            total = [sum(c["by_stage"].values()) for c in spent]
            row: dict[str, Any] = {
                "faults": len(mine),
                "p50_ms": statistics.median(mine),
                "p99_ms": _pct(mine, 0.99),
                "max_ms": max(mine),
                "standby_used": standby[k]["used"],
                "standby_built": standby[k]["built"],
                "data_timeouts_s": sorted(used[k]),
                # the first fault of each trial lands in its second step, on the first
                # step's start-up work; shown apart, never left out of the figures above
                "first_fault_ms": firsts[k],
                "max_ms_after_first_fault": max(later, default=None),
                # the CPU the ranks spend on a recovery, and the least wall time the host's
                # cores could give it were that work spread over them perfectly
                "ranks_per_core": n / cores,
                "cpu_ms_all_ranks_p50": statistics.median(total) if total else None,
                "cpu_floor_ms_p50": statistics.median(total) / min(n, cores) if total else None,
                "cpu_ms_by_stage_p50": {
                    s: round(statistics.median(c["by_stage"].get(s, 0.0) for c in spent), 3) for s in STAGES
                }
                if spent
                else {},
                # where each rank's CPU goes: its own process CPU by step (p50 over
                # the recoveries), beside the sum over the ranks above
                "cpu_ms_by_rank_by_stage_p50": _by_rank_p50(spent),
                "main_thread_cpu_ms_by_stage_p50": {
                    s: round(statistics.median(c["main_by_stage"].get(s, 0.0) for c in spent), 3) for s in STAGES
                }
                if spent
                else {},
                "after_resume_cpu_ms_p50": (statistics.median(c["after_resume"] for c in spent) if spent else None),
                "over_100_ms": tails[k],
                "flush": _flush_summary(flushes[k]),
            }
            text = f"{row['p50_ms']:.1f} / {row['p99_ms']:.1f} / {row['max_ms']:.1f}"
            if total:
                text += (
                    f"  |  CPU {row['cpu_ms_all_ranks_p50']:.1f} ms over {n} ranks on {cores} cores: at least "
                    f"{row['cpu_floor_ms_p50']:.1f} ms"
                )
            if t == timeouts[0] and theirs[n]:
                peer = theirs[n]
                row["torchft"] = {
                    "rounds": len(peer),
                    "p50_ms": statistics.median(peer),
                    "p99_ms": _pct(peer, 0.99),
                    "max_ms": max(peer),
                }
                row["ratio_p50"] = row["p50_ms"] / row["torchft"]["p50_ms"]
                if theirs_cpu[n] and total:  # the same measure of CPU, on the same machine at the same time
                    row["torchft"]["cpu_ms_all_ranks_p50"] = statistics.median(theirs_cpu[n])
                    row["cpu_ratio_p50"] = row["cpu_ms_all_ranks_p50"] / row["torchft"]["cpu_ms_all_ranks_p50"]
                text += (
                    f"  |  {row['torchft']['p50_ms']:.1f} / {row['torchft']['p99_ms']:.1f} / "
                    f"{row['torchft']['max_ms']:.1f}  |  {row['ratio_p50']:.2f}"
                )
                if "cpu_ratio_p50" in row:
                    text += (
                        f"  |  CPU {row['cpu_ms_all_ranks_p50']:.1f} against torchft's "
                        f"{row['torchft']['cpu_ms_all_ranks_p50']:.1f}: {row['cpu_ratio_p50']:.2f}"
                    )
            by_ranks[n] = row
            rows.append(
                (
                    f"{n} ranks, data path {t:g} s (ran with {', '.join(f'{x:g}' for x in sorted(used[k]))} s): "
                    f"meshpact recovery ({len(mine)} faults; standby used {standby[k]['used']}, built "
                    f"{standby[k]['built']}) | its CPU, all ranks (p50), and the wall time that CPU needs at "
                    "least"
                    + (
                        " | torchft configure + first allreduce | ratio of p50 | CPU, all ranks (p50), "
                        "against torchft's and their ratio"
                        if t == timeouts[0]
                        else ""
                    )
                    + " (ms, p50 / p99 / max)",
                    text,
                )
            )
            if spent:
                rows.append(
                    (
                        f"  CPU by step, all {n} ranks (ms, p50: " + " / ".join(STAGES) + "; after resuming, apart)",
                        " / ".join(f"{row['cpu_ms_by_stage_p50'][s]:.2f}" for s in STAGES)
                        + f"; {row['after_resume_cpu_ms_p50']:.2f}",
                    )
                )
                for r, mine in row["cpu_ms_by_rank_by_stage_p50"].items():
                    rows.append(
                        (
                            f"    rank {r}: CPU by step (ms, p50, same order; its total)",
                            " / ".join(f"{mine[s]:.2f}" for s in STAGES) + f"; {mine['total']:.2f}",
                        )
                    )
        by_timeout[label] = by_ranks
    if torchft_error is not None:
        rows.append(("torchft", torchft_error))
    head = by_timeout[f"{timeouts[0]:g}s"]
    four = head.get(4, next(iter(head.values())))
    out.update(
        {
            "recovery_ms_by_ranks": head,
            "recovery_ms_p50": four["p50_ms"],
            "recovery_ms_p99": four["p99_ms"],
            "recovery_ms_max": four["max_ms"],
            "recoveries": four["faults"],
            "cpu_ms_all_ranks_p50": four["cpu_ms_all_ranks_p50"],
            "cpu_ms_by_stage_p50": four["cpu_ms_by_stage_p50"],
            "cpu_ratio_p50_vs_torchft": four.get("cpu_ratio_p50"),
            "recovery_ms_by_timeout": {
                label: {
                    n: {k: r[k] for k in ("faults", "p50_ms", "p99_ms", "max_ms", "data_timeouts_s", "over_100_ms")}
                    for n, r in rows_.items()
                }
                for label, rows_ in by_timeout.items()
            },
            "recovery_ms_max_by_timeout": {
                label: {n: r["max_ms"] for n, r in rows_.items()} for label, rows_ in by_timeout.items()
            },
            "side_by_side_load_avg_1m": load,
            "torchft": ({n: head[n].get("torchft") for n in sizes} if torchft_error is None else None),
            "torchft_missing_reason": torchft_error,
            "side_by_side_bit_identical": identical,
            "bit_identical": identical and out.get("bit_identical", True),
        }
    )
    return rows


def false_alarms(out: dict[str, Any], minutes: float) -> list[tuple[str, str]]:
    """A fault-free run of ``minutes`` on 4 ranks at the default settings: every recovery is
    a false alarm; heartbeat alarms are counted apart."""
    from meshpact.live.launch.launcher import host_store, launch

    seconds = minutes * 60.0
    control = host_store("127.0.0.1", 0, 4)
    load_start = os.getloadavg()
    results = launch(
        "meshpact.live.trials.probe:false_alarm_probe",
        4,
        {"seconds": seconds},
        timeout_s=seconds + 600,
        env=lambda r: {"MESHPACT_CONTROL_ADDR": "127.0.0.1", "MESHPACT_CONTROL_PORT": str(control.port)},
    )
    vals = [r.value for r in results]
    load_end = os.getloadavg()
    out.update(
        {
            "false_alarms": max(v["recoveries"] for v in vals),
            "false_alarm_heartbeat_alarms": sum(v["heartbeat_alarms"] for v in vals),
            "false_alarm_run": {
                "minutes": minutes,
                "ranks": 4,
                "steps": vals[0]["steps"],
                "heartbeat": vals[0]["heartbeat"],
                "load_avg_1m_5m_15m_at_start": [round(x, 2) for x in load_start],
                "load_avg_1m_5m_15m_at_end": [round(x, 2) for x in load_end],
            },
        }
    )
    return [
        (
            f"false alarms, 4 ranks, {minutes:g} min with no fault, defaults (heartbeat "
            f"{'on' if vals[0]['heartbeat'] else 'off'}; {vals[0]['steps']} steps): recoveries / heartbeat alarms",
            f"{out['false_alarms']} / {out['false_alarm_heartbeat_alarms']}",
        ),
        (
            "load average during it (1 min at start / at end; 15 min at end)",
            f"{load_start[0]:.2f} / {load_end[0]:.2f}; {load_end[2]:.2f}",
        ),
    ]


def stall_detection(out: dict[str, Any], faults: int) -> list[tuple[str, str]]:
    """Stalled ranks found by the heartbeat (default interval and misses) under a 30 s data-path
    timeout that would wait out each 2 s stall: injection -> first rank knowing; then cut data
    links (3 s each), which only the heartbeat's quiet-data-path rule can find under that
    timeout."""
    from meshpact.core.recording import EventKind

    result = run_trial(
        TrialConfig(
            ranks=4,
            steps=faults + 6,
            faults=faults,
            fault_kind=FaultKind.STALL,
            checkpoint_every=4,
            baselines=False,
            data_timeout_s=30.0,
            stall_s=2.0,
            heartbeat=True,
        )
    )
    det = [r["detection_s"] * 1e3 for r in result.recoveries()]
    _downtime(out, "stall", result, "in_memory")
    bound_ms = result.config.recovery().heartbeat_detect_s * 1e3
    out.update(
        {
            "stall_detect_ms_p50": statistics.median(det),
            "stall_detect_ms_max": max(det),
            "stall_detect_bound_ms": bound_ms,
            "stall_faults": len(det),
            "stall_bit_identical": result.bit_identical,
        }
    )
    rows = [
        (
            f"stall found by heartbeat, 4 ranks, {len(det)} stalls, data path 30 s (ms, p50 / max; bound)",
            f"{statistics.median(det):.1f} / {max(det):.1f}; {bound_ms:.0f}",
        )
    ]
    from meshpact.live.recovery.faults import netns_unavailable

    why = netns_unavailable()
    if why is not None:  # a cut link needs network namespaces (root, ip)
        out["partition_detect_missing_reason"] = why
        return rows + [("cut data link found by heartbeat", f"not measured: {why}")]
    cuts = max(1, faults // 3)  # each cut lasts 3 s: fewer of them
    result = run_trial(
        TrialConfig(
            ranks=4,
            steps=3 * cuts + 6,
            faults=cuts,
            fault_kind=FaultKind.PARTITION,
            checkpoint_every=4,
            baselines=False,
            data_timeout_s=30.0,
            down_s=3.0,
        )
    )
    det = [r["detection_s"] * 1e3 for r in result.recoveries()]
    quiet = sum(1 for e in result.events() if e.event == EventKind.DETECTED and e.data.get("heartbeat_quiet"))
    out.update(
        {
            "partition_detect_ms_p50": statistics.median(det) if det else None,
            "partition_detect_ms_max": max(det, default=None),
            "partition_faults": len(det),
            "partition_found_by_quiet_rule": quiet > 0,
            "partition_bit_identical": result.bit_identical,
        }
    )
    return rows + [
        (
            f"cut data link found by heartbeat (quiet data path), 4 ranks, {len(det)} cuts of 3 s, data "
            "path 30 s (ms, p50 / max)",
            f"{statistics.median(det):.1f} / {max(det):.1f}" if det else "none",
        )
    ]


def _report(rows: list[tuple[str, str]], out: dict[str, Any], results_dir: str | None = None) -> None:
    out["machine"]["load_avg_1m_at_end"] = round(os.getloadavg()[0], 2)
    if out.get("fault_to_running_ms_by_kind"):
        out[FAULT_TO_RUNNING] = p50_by_kind(out["fault_to_running_ms_by_kind"])
        rows.insert(
            0,
            (
                "fault -> every rank running the next step, detection included, by fault kind (ms, p50)",
                ", ".join(f"{k} {'-' if v is None else format(v, '.1f')}" for k, v in out[FAULT_TO_RUNNING].items()),
            ),
        )
    width = max(len(k) for k, _ in rows)
    print("Meshpact live recovery benchmark")
    for k, v in rows:
        print(f"  {k.ljust(width)}  {v}")
    if results_dir is None:
        emit("recovery", out)
    else:
        emit("recovery", out, Path(results_dir))


if __name__ == "__main__":
    sys.exit(main())
