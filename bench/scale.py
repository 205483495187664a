"""Benchmark: recovery, downtime and memory against a rank's state size.

Its headline, ``fault_to_running_ms_p50_by_kind`` (per workload, per path): the downtime a user
sees, from the fault (a raised collective's raise, a kill's signal, a stall's start) to every rank
running the next step (its first collective on the new group, after any replay), detection
included; beside it ``knew_spread_ms_p50_by_kind``, the first rank knowing of the fault -> every
rank knowing. ``--downtime-only`` measures only these (no plain runs, no memory), written to
``bench/results/scale-downtime.json``.

Measures on this machine, in one run:

- the same large workload (``gpt100m``: 110 M parameters, float32, AdamW, FSDP2 over 4 ranks)
  trained under plain ``torchrun`` without Meshpact, writing no checkpoint: each rank's peak
  resident memory and step time, the baseline the extra memory is counted against;
- Meshpact trials of the tiny (``decoder``) and the large workload on every recovery path: a
  collective fault (in-memory), a stall (found by the heartbeat), a kill (peer restore), and
  a kill excised (``--on-rank-loss excise``), one peer copy per rank, each judged
  bit-identical against its reference, with the recoveries nobody planned counted
  (``unplanned_recoveries``: recoveries beyond the faults injected at their step, a false alarm
  each; ``unrecovered_faults``: faults injected at a step no recovery was for, a fault missed);
- ``recovery_ms_p50_by_state_mb``: the in-memory recoveries (collective and stall) themselves (the stages after every rank
  knew: consensus, communicator, rebinding, state),
  p50 per workload keyed by the rank's state in MB, and the ratio large / tiny (a recovery of those paths that consensus
  decided otherwise, such as a checkpoint restore where a rank's optimizer had stepped, is left out: each
  path's ``policies`` lists what every recovery was); the detection stage (the fault -> every
  rank knowing; for a raised collective, timed from its raise) is ``skew_ms_p50_by_state_mb``
  beside it, apart from the recovery;
- ``extra_rss_per_rank_over_state`` per path: the largest peak resident memory of a rank of
  the faulted run less the plain run's largest, over one rank's state bytes
  (``extra_rss_mb_per_rank``: the same difference in MB). Both runs' ranks are watched the same
  way (``VmHWM``, the kernel's exact peak, read from ``/proc`` every 20 ms while they run; the
  sampled peak of anonymous memory, ``RssAnon``, beside it as ``extra_anon_per_rank_over_state``).
  Where a workload's state per rank is under ``RATIO_MIN_STATE_MB`` the ratio is None and only
  the MB are given: the tiny workload's 0.3 MB would turn the few MB by which any two Python
  processes differ (a trial's ranks are forked from a server with torch imported, the plain
  ranks start afresh) into ratios of hundreds;
- for the excision, beside it, the same on the world the excision leaves (``ranks - 1``: every
  survivor's shard is ``ranks / (ranks - 1)`` of before, in this job or any other that goes on
  without a rank): the peak less the plain loop's on ``ranks - 1`` ranks, over a survivor's own
  state there (the plain loop's on ``ranks - 1``), ``extra_rss_excised_over_own_state``. The
  excised run's peak comes at or after the excision, on the larger shard (a probe in an earlier
  run placed it in the steps after; this bench does not time it);
  ``extra_rss_per_rank_over_state`` counts it against the start's world and shard;
- the allocator, held equal: every process of both runs starts with glibc's mmap threshold
  fixed (``--mmap-threshold``, 1 MiB; ``MALLOC_MMAP_THRESHOLD_``), so a tensor of a megabyte or
  more is mapped and unmapped whole and a run's peak is what it holds. With glibc's default
  (a threshold that rises to 32 MiB as large blocks are freed) both runs keep 1-2 GB of freed
  tensors in the heap, and how much varies run to run by about the state of a rank: the plain
  run of ``gpt100m`` peaked at 2.16-2.32 GB per rank in three runs, 1.01 GB in every rank with
  the threshold fixed. ``--mmap-threshold 0`` measures with glibc's default;
- ``commit_overhead_ms`` (the training thread's snapshot at each commit) and
  ``peer_copy_step_latency`` (step-latency overhead of the copies) at both sizes.

Prints a table for people and one JSON line (the last line) for machines, also written to
``bench/results/scale.json`` with the load average, date, machine and commit (``bench/_results.py``).

The trials run with the default settings (the data-path timeout follows the job) unless
``--data-timeout`` sets one. The in-memory paths (collective, stall) inject ``--faults`` faults
each, so the p50 is over several recoveries: a collective fault from step 1 on, a stall from step
2 on (``faults.first_fault_step``: the heartbeat judges a rank from its second completed step, and
a stall in step 1 is only a slow step); more faults than ``--steps`` holds is refused in one line
before anything runs. ``--logs DIR`` keeps each path's rank logs and recording (what detected
each recovery: a fault's collective, the heartbeat, a timeout).

With ``--peer-copy-depth 1`` (one own snapshot and one held copy per source instead of two of
each) the run is written to ``bench/results/scale-depth1.json`` instead.

Usage: ``python bench/scale.py [--steps 8] [--faults 3] [--ranks 4] [--data-timeout S] [--peer-copy-depth 2]
[--paths collective,stall,kill,excise] [--mmap-threshold BYTES] [--logs DIR]``.
Under ``torchrun`` with ``--plain WORKLOAD`` it is the plain loop itself (one rank).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from _results import FAULT_TO_RUNNING, emit, p50_by_kind

MMAP_THRESHOLD = 1 << 20  # bytes: glibc's mmap threshold in every process of both runs (0: glibc's own, dynamic)
RATIO_MIN_STATE_MB = 64.0  # below this much state per rank the extra memory is given in MB only, not as a ratio

PATHS = {
    "collective": ("collective", "replace"),
    "stall": ("stall", "replace"),
    "kill": ("kill", "replace"),
    "excise": ("kill", "excise"),
}
POLICY = {"collective": "in_memory", "stall": "in_memory", "kill": "peer_restore", "excise": "excise"}


# -- the plain loop (one torchrun rank) ------------------------------------------------------------
def plain_rank(workload: str, steps: int, out_dir: str) -> None:
    import resource

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from meshpact.live.recovery.workload import load_workload

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    Path(out_dir, f"pid{rank}").write_text(str(os.getpid()))  # the bench watches this process as it watches a trial's
    wl = load_workload(workload, world)
    model, optimizer = wl.build(init_device_mesh("cpu", (world,)))
    step_s = []
    for step in range(steps):
        t0 = time.perf_counter()
        wl.train_step(model, optimizer, wl.batch(step, rank))
        step_s.append(time.perf_counter() - t0)
    state = sum(t.numel() * t.element_size() for t in _local_tensors(model, optimizer))
    Path(out_dir, f"rank{rank}.json").write_text(
        json.dumps(
            {
                "rank": rank,
                "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                "state_bytes": state,
                "step_s": step_s,
            }
        )
    )
    dist.destroy_process_group()


def _local_tensors(model: Any, optimizer: Any) -> list[Any]:
    from meshpact.live.recovery.state import local_state

    return list(local_state(model, optimizer).values())


@dataclass(frozen=True)
class PlainRun:
    peak_rss_bytes: int  # the largest rank's (VmHWM, watched as a trial's ranks are)
    peak_anon_bytes: int  # the largest rank's sampled peak of anonymous memory (RssAnon)
    state_bytes: int  # the largest rank's own state
    step_s_p50: float


def run_plain(workload: str, ranks: int, steps: int) -> PlainRun:
    out_dir = tempfile.mkdtemp(prefix="meshpact-bench-plain-")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={ranks}",
        __file__,
        "--plain",
        workload,
        "--steps",
        str(steps),
        "--out",
        out_dir,
    ]
    with RssWatch(lambda: _plain_pids(Path(out_dir))) as watch:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, check=False)
    rows = [json.loads(p.read_text()) for p in sorted(Path(out_dir).glob("rank*.json"))]
    shutil.rmtree(out_dir, ignore_errors=True)
    if len(rows) != ranks:
        raise RuntimeError(
            f"the plain run of {workload} ended with {len(rows)} of {ranks} ranks reporting:\n{out.stderr[-2000:]}"
        )
    steps_s = [s for r in rows for s in r["step_s"][1:]] or [s for r in rows for s in r["step_s"]]
    own = max(r["peak_rss_bytes"] for r in rows)  # ru_maxrss: only where the watch saw no rank
    return PlainRun(
        watch.peak("plain") or own,
        watch.peak("plain", anon=True),
        max(r["state_bytes"] for r in rows),
        statistics.median(steps_s),
    )


def _plain_pids(out_dir: Path) -> list[tuple[tuple[str, int, int], int]]:
    """(("plain", rank, 0), pid) of each plain rank that has written its pid so far."""
    out = []
    for p in out_dir.glob("pid*"):
        try:
            out.append((("plain", int(p.name[3:]), 0), int(p.read_text())))
        except (OSError, ValueError):
            continue
    return out


def _trial_pids(work: Path) -> list[tuple[tuple[str, int, int], int]]:
    """((run, rank, incarnation), pid) of every rank process a trial's registry lists so far."""
    from meshpact.live.trials.trialconfig import PROCESSES_FILE

    try:
        rows = [json.loads(line) for line in (work / PROCESSES_FILE).read_text().splitlines() if line]
    except (OSError, ValueError):
        return []
    return [
        ((row["run_id"], int(row["rank"]), int(row["incarnation"])), int(row["pid"]))
        for row in rows
        if row.get("rank") is not None
    ]


# -- Meshpact trials, their processes' peak memory watched ---------------------------------------------
@dataclass
class RssWatch:
    """Polls ``/proc/<pid>/status`` of every process ``pids()`` lists, the plain run's ranks and a
    trial's alike: ``VmHWM`` (the kernel's peak resident memory, exact) and ``RssAnon`` (anonymous
    memory, its peak as sampled every 20 ms)."""

    pids: Callable[[], list[tuple[tuple[str, int, int], int]]]  # ((run, rank, incarnation), pid)
    peaks: dict[tuple[str, int, int], int] = field(default_factory=dict)  # (run, rank, incarnation) -> bytes
    anon: dict[tuple[str, int, int], int] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)

    def __enter__(self) -> "RssWatch":
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            for key, pid in self.pids():
                try:
                    status = Path(f"/proc/{pid}/status").read_text()
                except OSError:
                    continue
                kb = {
                    line.split(":")[0]: int(line.split()[1])
                    for line in status.splitlines()
                    if line.startswith(("VmHWM:", "RssAnon:"))
                }
                self.peaks[key] = max(self.peaks.get(key, 0), kb.get("VmHWM", 0) * 1024)
                self.anon[key] = max(self.anon.get(key, 0), kb.get("RssAnon", 0) * 1024)

    def peak(self, run: str, anon: bool = False) -> int:
        return max((v for (r, _, _), v in (self.anon if anon else self.peaks).items() if r == run), default=0)


@dataclass(frozen=True)
class PathRun:
    workload: str
    path: str
    bit_identical: bool
    policy_count: int
    faults_injected: int
    recoveries: int
    recovery_ms: list[float]  # first rank knowing -> every rank through the first collective
    detection_ms: list[float]
    peak_rss_bytes: int  # the faulted run's largest rank (VmHWM)
    peak_anon_bytes: int  # the faulted run's largest rank's sampled peak of RssAnon
    commit_ms: float | None
    step_latency: float | None
    error: str | None = None
    stages_ms: dict[str, float] = field(
        default_factory=dict
    )  # each stage's p50 over the recoveries, first collective apart
    skew_ms: list[float] = field(default_factory=list)  # the detection stage: until every rank knew
    own_ms: list[float] = field(default_factory=list)  # the recovery itself: every stage after detection
    policies: list[str] = field(default_factory=list)  # each recovery's policy, in the order of the lists above
    recovery_steps: list[int] = field(default_factory=list)  # the step each recovery was for
    fault_steps: list[int] = field(default_factory=list)  # the step of each fault injected
    fault_to_running_ms: list[float] = field(default_factory=list)  # injection -> every rank ran the next step
    knew_spread_ms: list[float] = field(default_factory=list)  # the first rank knowing -> every rank knowing
    heard_spread_ms: list[float] = field(default_factory=list)  # ... -> every rank's process heard (analysis)

    def _by_step(self, sign: int) -> int:
        """Per step, recoveries less faults (``sign`` 1) or faults less recoveries (-1), summed
        where positive: a recovery at a step no fault was injected at is a false alarm, even
        where another step's fault went unrecovered."""
        steps = set(self.recovery_steps) | set(self.fault_steps)
        return sum(max(sign * (self.recovery_steps.count(st) - self.fault_steps.count(st)), 0) for st in steps)

    @property
    def unplanned(self) -> int:
        if not self.recovery_steps and not self.fault_steps:  # a path that failed: only the counts
            return max(self.recoveries - self.faults_injected, 0)
        return self._by_step(1)

    @property
    def unrecovered(self) -> int:
        return self._by_step(-1) if self.recovery_steps or self.fault_steps else 0


def run_path(
    workload: str,
    path: str,
    ranks: int,
    steps: int,
    data_timeout_s: float | None,
    ref: Path,
    root: Path,
    faults: int = 1,
    depth: int = 2,
    logs: str | None = None,
    deadline_s: float | None = None,
) -> PathRun:
    from meshpact.live.trials.analysis import heard_spread_ms
    from meshpact.live.trials.trial import TrialConfig, run_trial

    kind, on_loss = PATHS[path]
    faults = faults if POLICY[path] == "in_memory" else 1
    kw: dict[str, Any] = {
        "ranks": ranks,
        "steps": steps,
        "faults": faults,
        "fault_kind": kind,
        "on_rank_loss": on_loss,
        "checkpoint_every": steps,
        "baselines": False,
        "peer_copies": 1,
        "workload": workload,
        "peer_copy_depth": depth,
    }
    if data_timeout_s is not None:
        kw["data_timeout_s"] = data_timeout_s
    if deadline_s is not None:
        kw["timeout_s"] = deadline_s
    work = Path(tempfile.mkdtemp(prefix=f"{Path(workload).stem}-{path}-", dir=root))
    try:
        cfg = TrialConfig(**kw)
        with RssWatch(lambda: _trial_pids(work)) as watch:
            result = run_trial(cfg, work_dir=work, reference_dir=ref if on_loss == "replace" else None)
    except Exception as exc:  # noqa: BLE001  (one path failing is a row of the table, not the end of the bench)
        return PathRun(workload, path, False, 0, faults, 0, [], [], 0, 0, None, None, str(exc).splitlines()[0][:300])
    finally:  # a large workload's checkpoints and final states are gigabytes a path: kept only as numbers
        if logs is not None:  # the ranks' own logs and the recording: what each recovery's detection saw
            keep = Path(logs) / f"{Path(workload).stem}-{path}"
            keep.mkdir(parents=True, exist_ok=True)
            for f in [*(work / "faulted").glob("*.jsonl"), *work.glob("*.jsonl")]:
                shutil.copy2(f, keep / f.name)
        for sub in ("checkpoints", "faulted", "excising-reference", "ref-checkpoints"):
            shutil.rmtree(work / sub, ignore_errors=True)
    s = result.summary()
    recs = result.recoveries()
    overhead = s.get("peer_copy_overhead") or {}
    return PathRun(
        workload,
        path,
        bool(s["bit_identical"]),
        int(s["policy_counts"][POLICY[path]]),
        int(s["faults_injected"]),
        len(recs),
        [r["recovery_s"] * 1e3 for r in recs],
        [r["detection_s"] * 1e3 for r in recs],
        watch.peak("faulted"),
        watch.peak("faulted", anon=True),
        overhead.get("snapshot_ms_per_commit"),
        overhead.get("step_latency"),
        stages_ms={k: statistics.median(v) for k, v in _stage_lists(recs).items()},
        skew_ms=[r["stages_s"].get("detection", 0.0) * 1e3 for r in recs],
        own_ms=[sum(v for k, v in r["stages_s"].items() if k != "detection") * 1e3 for r in recs],
        policies=[r["policy"] for r in recs],
        recovery_steps=[int(r["step"]) for r in recs],
        fault_steps=sorted(rec.step for rec in result.fault_records.values()),
        fault_to_running_ms=result.fault_to_running_ms(POLICY[path]),
        knew_spread_ms=[r["knew_spread_s"] * 1e3 for r in recs if r["policy"] == POLICY[path]],
        heard_spread_ms=heard_spread_ms(result.events()),
    )


def _stage_lists(recs: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Each stage's milliseconds over ``recs`` (the first collective on the new groups apart)."""
    out: dict[str, list[float]] = {}
    for r in recs:
        for k, v in {**r["stages_s"], "first_collective": r["first_collective_s"]}.items():
            out.setdefault(k, []).append(v * 1e3)
    return out


# -- the run ------------------------------------------------------------------------------------------
def _p50(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _ratio(large: float | None, tiny: float | None) -> float | None:
    return large / tiny if large and tiny else None


def downtime(runs: list[PathRun], workloads: tuple[str, ...]) -> dict[str, Any]:
    """The headline: per workload and fault kind (path), fault -> every rank running the next step
    (:data:`FAULT_TO_RUNNING`), and beside it how long after the first rank the last one knew (its
    step raised) and the last one's process heard (:func:`~meshpact.live.trials.analysis.heard_spread_ms`)."""
    return {
        FAULT_TO_RUNNING: {
            w: p50_by_kind({r.path: r.fault_to_running_ms for r in runs if r.workload == w}) for w in workloads
        },
        "knew_spread_ms_p50_by_kind": {
            w: p50_by_kind({r.path: r.knew_spread_ms for r in runs if r.workload == w}) for w in workloads
        },
        "heard_spread_ms_p50_by_kind": {
            w: p50_by_kind({r.path: r.heard_spread_ms for r in runs if r.workload == w}) for w in workloads
        },
    }


def _downtime_rows(runs: list[PathRun]) -> None:
    print(
        f"{'workload/path':<22} {'bit-id':>6} {'faults':>6} {'fault->running ms p50':>22} {'knew spread ms p50':>19} "
        f"{'knew spread ms each'} {'heard spread ms each'}"
    )
    for r in runs:
        print(
            f"{r.workload + '/' + r.path:<22} {str(r.bit_identical):>6} {len(r.fault_to_running_ms):>6} "
            f"{(_p50(r.fault_to_running_ms) or float('nan')):>22.1f} {(_p50(r.knew_spread_ms) or float('nan')):>19.1f} "
            f"{[round(x) for x in r.knew_spread_ms]} {[round(x) for x in r.heard_spread_ms]}"
            + (f"  {r.error}" if r.error else "")
        )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plain", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--faults", type=int, default=3, help="faults per in-memory path (collective, stall)")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--tiny", default="decoder")
    parser.add_argument("--large", default="gpt100m")
    parser.add_argument(
        "--data-timeout",
        type=float,
        default=None,
        help="the data-path timeout of the trials (default: the trials' own)",
    )
    parser.add_argument("--paths", default=",".join(PATHS))
    parser.add_argument(
        "--peer-copy-depth",
        type=int,
        default=2,
        choices=(1, 2),
        help="committed steps kept of each peer copy and own snapshot",
    )
    parser.add_argument(
        "--logs",
        default=None,
        help="keep each path's rank logs and recording under this folder (what detected each recovery)",
    )
    parser.add_argument(
        "--downtime-only",
        action="store_true",
        help="only the trials' downtime (fault -> every rank running; no plain runs, no memory): "
        "written to bench/results/scale-downtime.json",
    )
    parser.add_argument(
        "--security-cost",
        type=int,
        default=0,
        metavar="PAIRS",
        help="with --downtime-only: also PAIRS pairs of --large trials with the job key on and off, "
        "interleaved, and the copies' digests timed on a rank's payload (the security measures' "
        "cost)",
    )
    parser.add_argument(
        "--trial-deadline",
        type=float,
        default=None,
        metavar="S",
        help="with --downtime-only: each trial run's launcher deadline (default: derived from its "
        "steps; a machine whose cores other jobs hold may need more)",
    )
    parser.add_argument(
        "--workloads",
        default=None,
        help="with --downtime-only: the workloads, comma-separated (default: --tiny and --large)",
    )
    parser.add_argument(
        "--mmap-threshold",
        type=int,
        default=MMAP_THRESHOLD,
        help="glibc's mmap threshold in bytes for every process of both runs (0: glibc's default)",
    )
    args = parser.parse_args(argv)
    from meshpact.core.errors import MeshpactError
    from meshpact.live.recovery.faults import plan_faults

    if args.plain:
        plain_rank(args.plain, args.steps, args.out)
        return {}
    paths = [p for p in args.paths.split(",") if p]
    bad = [p for p in paths if p not in PATHS]
    if bad:
        parser.error(f"--paths takes {', '.join(PATHS)}; got {', '.join(bad)}")
    for p in paths:  # every fault asked for is placed, or the bench says in one line why it cannot be
        try:
            plan_faults(PATHS[p][0], args.steps, args.faults if POLICY[p] == "in_memory" else 1, args.ranks)
        except MeshpactError as exc:
            parser.error(f"the {p} path: {exc}")
    if args.mmap_threshold:  # read by glibc as each process starts: the plain ranks, the fork server, replacements
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold)
    else:
        os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
    root = Path(tempfile.mkdtemp(prefix="meshpact-bench-scale-"))
    if args.downtime_only:
        return downtime_only(args, paths, root)
    plain = {w: run_plain(w, args.ranks, args.steps) for w in (args.tiny, args.large)}
    # the world an excision leaves: each survivor's shard is ranks / (ranks - 1) of before, in any job that goes on
    survivors = run_plain(args.large, args.ranks - 1, args.steps) if "excise" in paths and args.ranks > 2 else None
    runs: list[PathRun] = []
    for w in (args.tiny, args.large):
        ref = root / f"ref-{w}" / "reference"
        for path in paths:
            runs.append(
                run_path(
                    w,
                    path,
                    args.ranks,
                    args.steps,
                    args.data_timeout,
                    ref,
                    root,
                    args.faults,
                    args.peer_copy_depth,
                    args.logs,
                )
            )
            print(f"# {w} {path}: {runs[-1]}", file=sys.stderr, flush=True)
    state_mb = {w: plain[w].state_bytes / 2**20 for w in plain}
    in_memory = [p for p in paths if POLICY[p] == "in_memory"]

    def in_memory_ms(w: str, attr: str) -> list[float]:
        return [
            ms
            for r in runs
            if r.workload == w and r.path in in_memory
            for ms, policy in zip(getattr(r, attr), r.policies)
            if policy == "in_memory"
        ]

    rec = {w: _p50(in_memory_ms(w, "own_ms")) for w in plain}
    det = {w: _p50(in_memory_ms(w, "skew_ms")) for w in plain}
    extra_mb = {
        f"{r.workload}/{r.path}": (
            (r.peak_rss_bytes - plain[r.workload].peak_rss_bytes) / 2**20 if r.peak_rss_bytes else None
        )
        for r in runs
    }
    extra_anon_mb = {
        f"{r.workload}/{r.path}": (
            (r.peak_anon_bytes - plain[r.workload].peak_anon_bytes) / 2**20 if r.peak_anon_bytes else None
        )
        for r in runs
    }

    def over_state(mb: dict[str, float | None]) -> dict[str, float | None]:
        """Each path's extra over its workload's state per rank; None where that state is under
        RATIO_MIN_STATE_MB (a few MB of noise in a process's memory would be a ratio of hundreds)."""
        return {
            k: (
                v / state_mb[k.split("/")[0]]
                if v is not None and state_mb[k.split("/")[0]] >= RATIO_MIN_STATE_MB
                else None
            )
            for k, v in mb.items()
        }

    extra, extra_anon = over_state(extra_mb), over_state(extra_anon_mb)
    excise_vs_survivors = {
        f"{r.workload}/{r.path}": (r.peak_rss_bytes - survivors.peak_rss_bytes) / survivors.state_bytes
        for r in runs
        if survivors is not None
        and r.workload == args.large
        and r.path == "excise"
        and r.peak_rss_bytes
        and state_mb[r.workload] >= RATIO_MIN_STATE_MB
    }
    result = {
        "bench": "scale",
        "ranks": args.ranks,
        "steps": args.steps,
        "faults_per_in_memory_path": args.faults,
        "peer_copy_depth": args.peer_copy_depth,
        "data_timeout_s": args.data_timeout,
        "mmap_threshold_bytes": args.mmap_threshold or None,
        "ratio_min_state_mb": RATIO_MIN_STATE_MB,
        "state_mb_per_rank": {w: round(v, 3) for w, v in state_mb.items()},
        **downtime(runs, tuple(plain)),
        "recovery_ms_p50_by_state_mb": {f"{state_mb[w]:.3f}": rec[w] for w in plain},
        "recovery_ratio_large_over_tiny": _ratio(rec[args.large], rec[args.tiny]),
        "skew_ms_p50_by_state_mb": {f"{state_mb[w]:.3f}": det[w] for w in plain},
        "plain_peak_rss_mb": {w: plain[w].peak_rss_bytes / 2**20 for w in plain},
        "plain_peak_anon_mb": {w: plain[w].peak_anon_bytes / 2**20 for w in plain},
        "plain_step_s_p50": {w: plain[w].step_s_p50 for w in plain},
        "extra_rss_per_rank_over_state": extra,
        "extra_rss_mb_per_rank": extra_mb,
        "extra_anon_per_rank_over_state": extra_anon,
        # the excised run against the plain loop on the survivors' world (ranks - 1), over a survivor's own state there
        "plain_peak_rss_mb_survivor_world": survivors.peak_rss_bytes / 2**20 if survivors is not None else None,
        "state_mb_per_rank_survivor_world": survivors.state_bytes / 2**20 if survivors is not None else None,
        "extra_rss_excised_over_own_state": excise_vs_survivors,
        "commit_overhead_ms": {f"{r.workload}/{r.path}": r.commit_ms for r in runs if r.path == "collective"},
        "peer_copy_step_latency": {f"{r.workload}/{r.path}": r.step_latency for r in runs if r.path == "collective"},
        "paths": {
            f"{r.workload}/{r.path}": {
                "bit_identical": r.bit_identical,
                "recovered_by_policy": r.policy_count,
                "unplanned_recoveries": r.unplanned,
                "unrecovered_faults": r.unrecovered,
                "recovery_steps": r.recovery_steps,
                "fault_steps": r.fault_steps,
                "peak_rss_mb": r.peak_rss_bytes / 2**20,
                "peak_anon_mb": r.peak_anon_bytes / 2**20,
                "recovery_ms": r.recovery_ms,
                "own_ms": r.own_ms,
                "skew_ms": r.skew_ms,
                "policies": r.policies,
                "fault_to_running_ms": r.fault_to_running_ms,
                "knew_spread_ms": r.knew_spread_ms,
                "heard_spread_ms": r.heard_spread_ms,
                "stages_ms": r.stages_ms,
                "error": r.error,
            }
            for r in runs
        },
    }
    print(
        f"{'workload/path':<22} {'bit-id':>6} {'policy':>6} {'unplanned':>9} {'missed':>6} {'recovery ms':>12} {'skew ms':>8} "
        f"{'peak RSS MB':>11} {'extra MB':>9} {'extra/state':>11}"
    )
    for r in runs:
        key = f"{r.workload}/{r.path}"
        x = extra[key]
        own = _p50(r.own_ms)
        print(
            f"{key:<22} {str(r.bit_identical):>6} {r.policy_count:>6} {r.unplanned:>9} {r.unrecovered:>6} "
            f"{(own if own is not None else float('nan')):>12.1f} {(_p50(r.skew_ms) or float('nan')):>8.1f} "
            f"{r.peak_rss_bytes / 2**20:>11.0f} {(extra_mb[key] if extra_mb[key] is not None else float('nan')):>9.0f} "
            f"{(x if x is not None else float('nan')):>11.2f}" + (f"  {r.error}" if r.error else "")
        )
    _downtime_rows(runs)
    for w in plain:
        print(
            f"plain {w}: peak RSS {plain[w].peak_rss_bytes / 2**20:.0f} MB, state {state_mb[w]:.1f} MB per rank, "
            f"step {plain[w].step_s_p50:.2f} s"
        )
    print(
        f"in-memory recovery p50 (skew apart): {rec}; skew p50: {det}; large/tiny: "
        f"{result['recovery_ratio_large_over_tiny']}; load average {os.getloadavg()}"
    )
    shutil.rmtree(root, ignore_errors=True)
    emit("scale" if args.peer_copy_depth == 2 else f"scale-depth{args.peer_copy_depth}", result)
    return result


def security_cost(args: argparse.Namespace, root: Path, pairs: int) -> dict[str, Any]:
    """What the security measures cost at ``--large``: ``pairs`` pairs of trials (one peer copy per
    rank, ``--faults`` raised collectives each), the job key on (signed control values,
    authenticated peer-copy frames) and off (``MESHPACT_UNAUTHENTICATED=1``), interleaved and
    alternating which runs first, so both meet the same load: each one's median step (its faulted
    run's, the first step, the warm-up, left out; the fault-free reference is the one the paths
    ran) and in-memory recovery p50; the signing's overhead is the median ratio of a step with the
    key on to the same step of the same pair with it off. The copies' digests
    (BLAKE3 by the source before it ships, and by the holder as it receives) run with the key on
    and off alike: their CPU per commit is timed apart, on a payload of a rank's copy size, and
    counted against the CPU a rank has per step (the step's wall time times the cores per rank).
    ``commit_overhead``, the goal's number, is the signing's step overhead (negative counted as
    none) plus the digests' share."""
    from meshpact.live.recovery.peers import copy_digest
    from meshpact.live.recovery.faults import FaultKind
    from meshpact.live.trials.trial import TrialConfig, run_trial

    steps_ms: dict[str, list[float]] = {"on": [], "off": []}
    trial_steps_ms: dict[str, list[list[float]]] = {"on": [], "off": []}  # each trial's steps, in order
    rec_ms: dict[str, list[float]] = {"on": [], "off": []}
    payload_bytes: list[int] = []
    load = [round(os.getloadavg()[0], 2)]
    identical = True
    for i in range(pairs):
        for on in (True, False) if i % 2 == 0 else (False, True):
            side = "on" if on else "off"
            work = Path(tempfile.mkdtemp(prefix=f"security-{side}-", dir=root))
            cfg = TrialConfig(
                ranks=args.ranks,
                steps=args.steps,
                faults=args.faults,
                fault_kind=FaultKind.COLLECTIVE,
                checkpoint_every=args.steps,
                baselines=False,
                peer_copies=1,
                workload=args.large,
                peer_copy_depth=args.peer_copy_depth,
                authenticated=on,
                timeout_s=args.trial_deadline,
            )
            ref = root / f"ref-{args.large}" / "reference"
            try:
                result = run_trial(
                    cfg, work_dir=work, reference_dir=ref if (ref / "final-rank0.pt").is_file() else None
                )
            finally:
                shutil.rmtree(work, ignore_errors=True)
            identical = identical and result.bit_identical
            trial_steps_ms[side].append([s * 1e3 for o in result.faulted for s in o.step_s[1:]])
            steps_ms[side] += trial_steps_ms[side][-1]
            rec_ms[side] += [r["recovery_s"] * 1e3 for r in result.recoveries() if r["policy"] == "in_memory"]
            overhead = result.peer_copy_overhead() or {}
            if overhead.get("network_bytes_per_step"):
                payload_bytes.append(int(overhead["network_bytes_per_step"]) // args.ranks)
            load.append(round(os.getloadavg()[0], 2))
            print(
                f"# security {side}: steps ms {[round(x) for x in steps_ms[side]]}, recoveries ms "
                f"{[round(x) for x in rec_ms[side]]}, load {load[-1]}",
                file=sys.stderr,
                flush=True,
            )
    size = max(payload_bytes, default=0)
    payload = bytearray(os.urandom(1 << 20)) * max(1, size >> 20)
    digest_cpu = []
    for _ in range(3):
        c0 = time.thread_time()
        copy_digest([payload])
        digest_cpu.append(time.thread_time() - c0)
    del payload
    digest_ms = 2 * statistics.median(digest_cpu) * 1e3  # the source's, then the holder's on receipt
    step = {k: _p50(v) for k, v in steps_ms.items()}
    cores_per_rank = min(1.0, (os.cpu_count() or 1) / args.ranks)
    # the signing's overhead: the median, over each pair's steps taken in the same order, of the step with the
    # key on against the same step with it off (a run's steps alternate between two lengths here, and the
    # pooled medians of a few of each fall on whichever is more numerous: a ratio of those is noise)
    paired = [
        on / off
        for a, b in zip(trial_steps_ms["on"], trial_steps_ms["off"])
        if len(a) == len(b)
        for on, off in zip(a, b)
        if off > 0
    ]
    signing = statistics.median(paired) - 1.0 if paired else None
    share = digest_ms / (step["off"] * cores_per_rank) if step["off"] else None
    return {
        "workload": args.large,
        "pairs": pairs,
        "faults_per_trial": args.faults,
        "bit_identical": identical,
        "step_ms_p50": step,
        "signing_step_overhead": signing,
        "step_ms_each_trial": trial_steps_ms,
        "paired_step_ratios": len(paired),
        "recovery_ms_p50": {k: _p50(v) for k, v in rec_ms.items()},
        "recovery_ms": rec_ms,
        "payload_mb_per_commit": size / 2**20,
        "digest_cpu_ms_per_commit": digest_ms,
        "cores_per_rank": cores_per_rank,
        "digest_share_of_step": share,
        "commit_overhead": (max(signing, 0.0) + share) if signing is not None and share is not None else None,
        "load_avg_1m_after_each_trial": load,
    }


def downtime_only(args: argparse.Namespace, paths: list[str], root: Path) -> dict[str, Any]:
    """``--downtime-only``: each workload's trials on ``paths``, their downtime and nothing else."""
    workloads = tuple(w for w in (args.workloads or f"{args.tiny},{args.large}").split(",") if w)
    load = [round(os.getloadavg()[0], 2)]
    runs: list[PathRun] = []
    for w in workloads:
        ref = root / f"ref-{w}" / "reference"
        for path in paths:
            runs.append(
                run_path(
                    w,
                    path,
                    args.ranks,
                    args.steps,
                    args.data_timeout,
                    ref,
                    root,
                    args.faults,
                    args.peer_copy_depth,
                    args.logs,
                    args.trial_deadline,
                )
            )
            load.append(round(os.getloadavg()[0], 2))
            print(f"# {w} {path}: {runs[-1]}", file=sys.stderr, flush=True)
    result = {
        "bench": "scale",
        "ranks": args.ranks,
        "steps": args.steps,
        "faults_per_in_memory_path": args.faults,
        "peer_copy_depth": args.peer_copy_depth,
        "data_timeout_s": args.data_timeout,
        **downtime(runs, workloads),
        "load_avg_1m_after_each_path": load,
        "paths": {
            f"{r.workload}/{r.path}": {
                "bit_identical": r.bit_identical,
                "error": r.error,
                "policies": r.policies,
                "fault_steps": r.fault_steps,
                "recovery_steps": r.recovery_steps,
                "fault_to_running_ms": r.fault_to_running_ms,
                "knew_spread_ms": r.knew_spread_ms,
                "heard_spread_ms": r.heard_spread_ms,
                "skew_ms": r.skew_ms,
                "own_ms": r.own_ms,
                "stages_ms": r.stages_ms,
            }
            for r in runs
        },
    }
    _downtime_rows(runs)
    if args.security_cost > 0:  # the paths' numbers are kept first: the security trials take as long again
        emit("scale-downtime", result)
        try:
            security = security_cost(args, root, args.security_cost)
        except Exception as exc:  # noqa: BLE001  (a trial that failed is the result's note, not the end of it)
            security = {"workload": args.large, "pairs": args.security_cost, "error": str(exc).splitlines()[0][:300]}
        result["security_cost"] = security
        result["security_commit_overhead"] = security.get("commit_overhead")
        print(f"security measures at {args.large}: {json.dumps(security)}")
    shutil.rmtree(root, ignore_errors=True)
    print(f"load average {os.getloadavg()}")
    emit("scale-downtime", result)
    return result


if __name__ == "__main__":
    main()
