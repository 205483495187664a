"""Benchmark: recovery and memory at real state size, a tiny workload beside a 110 M-parameter one.

Measures on this machine, in one run:

- the same large workload (``gpt100m``: 110 M parameters, float32, AdamW, FSDP2 over 4 ranks)
  trained under plain ``torchrun`` without Meshpact: each rank's peak resident memory
  (``ru_maxrss``) and step time, the baseline the extra memory is counted against;
- Meshpact trials of the tiny (``decoder``) and the large workload on every recovery path: a
  collective fault (in-memory), a stall (found by the heartbeat), a kill (peer restore), and
  a kill excised (``--on-rank-loss excise``), one peer copy per rank, each judged
  bit-identical against its reference, with the recoveries nobody planned counted
  (``unplanned_recoveries``: recoveries beyond the faults injected);
- ``recovery_ms_p50_by_state_mb``: the in-memory recoveries (collective and stall) themselves (the stages after every rank
  knew: consensus, communicator, rebinding, state),
  p50 per workload keyed by the rank's state in MB, and the ratio large / tiny; the skew of
  ranks reaching the failed collective (first rank knowing -> every rank knowing, the
  detection stage) is ``skew_ms_p50_by_state_mb`` beside it, apart from the recovery;
- ``extra_rss_per_rank_over_state`` per path: the largest peak resident memory of a rank of
  the faulted run (``VmHWM``, read from ``/proc`` while it runs) less the plain run's largest,
  over one rank's state bytes;
- ``commit_overhead_ms`` (the training thread's snapshot at each commit) and
  ``peer_copy_step_latency`` (step-latency overhead of the copies) at both sizes.

Prints a table for people and one JSON line (the last line) for machines, also written to
``bench/results/scale.json`` with the load average, date, machine and commit (``bench/_results.py``).

The trials run with the default settings (the data-path timeout follows the job) unless
``--data-timeout`` sets one. The in-memory paths (collective, stall) inject ``--faults`` faults
each, so the p50 is over several recoveries.

With ``--peer-copy-depth 1`` (one own snapshot and one held copy per source instead of two of
each) the run is written to ``bench/results/scale-depth1.json`` instead.

Usage: ``python bench/scale.py [--steps 8] [--faults 3] [--ranks 4] [--data-timeout S] [--peer-copy-depth 2]
[--paths collective,stall,kill,excise]``.
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
from typing import Any

from _results import emit

PATHS = {"collective": ("collective", "replace"), "stall": ("stall", "replace"), "kill": ("kill", "replace"),
         "excise": ("kill", "excise")}
POLICY = {"collective": "in_memory", "stall": "in_memory", "kill": "peer_restore", "excise": "excise"}


# -- the plain loop (one torchrun rank) ------------------------------------------------------------
def plain_rank(workload: str, steps: int, out_dir: str) -> None:
    import resource

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from meshpact.live.recovery.workload import load_workload

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    wl = load_workload(workload, world)
    model, optimizer = wl.build(init_device_mesh("cpu", (world,)))
    step_s = []
    for step in range(steps):
        t0 = time.perf_counter()
        wl.train_step(model, optimizer, wl.batch(step, rank))
        step_s.append(time.perf_counter() - t0)
    state = sum(t.numel() * t.element_size() for t in _local_tensors(model, optimizer))
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(
        {"rank": rank, "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
         "state_bytes": state, "step_s": step_s}))
    dist.destroy_process_group()


def _local_tensors(model: Any, optimizer: Any) -> list[Any]:
    from meshpact.live.recovery.state import local_state

    return list(local_state(model, optimizer).values())


@dataclass(frozen=True)
class PlainRun:
    peak_rss_bytes: int  # the largest rank's
    state_bytes: int  # the largest rank's own state
    step_s_p50: float


def run_plain(workload: str, ranks: int, steps: int) -> PlainRun:
    out_dir = tempfile.mkdtemp(prefix="meshpact-bench-plain-")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", __file__,
           "--plain", workload, "--steps", str(steps), "--out", out_dir]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, check=False)
    rows = [json.loads(p.read_text()) for p in sorted(Path(out_dir).glob("rank*.json"))]
    shutil.rmtree(out_dir, ignore_errors=True)
    if len(rows) != ranks:
        raise RuntimeError(f"the plain run of {workload} ended with {len(rows)} of {ranks} ranks reporting:\n"
                           f"{out.stderr[-2000:]}")
    steps_s = [s for r in rows for s in r["step_s"][1:]] or [s for r in rows for s in r["step_s"]]
    return PlainRun(max(r["peak_rss_bytes"] for r in rows), max(r["state_bytes"] for r in rows),
                    statistics.median(steps_s))


# -- Meshpact trials, their processes' peak memory watched ---------------------------------------------
@dataclass
class RssWatch:
    """Polls ``VmHWM`` (peak resident memory) of every process a trial's registry lists."""

    work: Path
    peaks: dict[tuple[str, int, int], int] = field(default_factory=dict)  # (run, rank, incarnation) -> bytes
    _stop: threading.Event = field(default_factory=threading.Event)

    def __enter__(self) -> "RssWatch":
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        from meshpact.live.trials.trialconfig import PROCESSES_FILE

        while not self._stop.wait(0.1):
            try:
                rows = [json.loads(line) for line in (self.work / PROCESSES_FILE).read_text().splitlines() if line]
            except (OSError, ValueError):
                continue
            for row in rows:
                if row.get("rank") is None:
                    continue
                try:
                    status = Path(f"/proc/{row['pid']}/status").read_text()
                except OSError:
                    continue
                hwm = next((int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmHWM:")), 0)
                key = (row["run_id"], int(row["rank"]), int(row["incarnation"]))
                self.peaks[key] = max(self.peaks.get(key, 0), hwm)

    def peak(self, run: str) -> int:
        return max((v for (r, _, _), v in self.peaks.items() if r == run), default=0)


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
    peak_rss_bytes: int  # the faulted run's largest rank
    commit_ms: float | None
    step_latency: float | None
    error: str | None = None
    stages_ms: dict[str, float] = field(default_factory=dict)  # each stage's p50 over the recoveries, first collective apart
    skew_ms: list[float] = field(default_factory=list)  # the detection stage: until every rank knew
    own_ms: list[float] = field(default_factory=list)  # the recovery itself: every stage after detection

    @property
    def unplanned(self) -> int:
        return max(self.recoveries - self.faults_injected, 0)


def run_path(workload: str, path: str, ranks: int, steps: int, data_timeout_s: float | None, ref: Path,
             root: Path, faults: int = 1, depth: int = 2) -> PathRun:
    from meshpact.live.trials.trial import TrialConfig, run_trial

    kind, on_loss = PATHS[path]
    faults = faults if POLICY[path] == "in_memory" else 1
    kw: dict[str, Any] = {"ranks": ranks, "steps": steps, "faults": faults, "fault_kind": kind, "on_rank_loss": on_loss,
                          "checkpoint_every": steps, "baselines": False, "peer_copies": 1, "workload": workload,
                          "peer_copy_depth": depth}
    if data_timeout_s is not None:
        kw["data_timeout_s"] = data_timeout_s
    work = Path(tempfile.mkdtemp(prefix=f"{Path(workload).stem}-{path}-", dir=root))
    try:
        cfg = TrialConfig(**kw)
        with RssWatch(work) as watch:
            result = run_trial(cfg, work_dir=work, reference_dir=ref if on_loss == "replace" else None)
    except Exception as exc:  # noqa: BLE001  (one path failing is a row of the table, not the end of the bench)
        return PathRun(workload, path, False, 0, faults, 0, [], [], 0, None, None, str(exc).splitlines()[0][:300])
    finally:  # a large workload's checkpoints and final states are gigabytes a path: kept only as numbers
        for sub in ("checkpoints", "faulted", "excising-reference", "ref-checkpoints"):
            shutil.rmtree(work / sub, ignore_errors=True)
    s = result.summary()
    recs = result.recoveries()
    overhead = s.get("peer_copy_overhead") or {}
    return PathRun(workload, path, bool(s["bit_identical"]), int(s["policy_counts"][POLICY[path]]),
                   int(s["faults_injected"]), len(recs), [r["recovery_s"] * 1e3 for r in recs],
                   [r["detection_s"] * 1e3 for r in recs], watch.peak("faulted"),
                   overhead.get("snapshot_ms_per_commit"), overhead.get("step_latency"),
                   stages_ms={k: statistics.median(v) for k, v in _stage_lists(recs).items()},
                   skew_ms=[r["stages_s"].get("detection", 0.0) * 1e3 for r in recs],
                   own_ms=[sum(v for k, v in r["stages_s"].items() if k != "detection") * 1e3 for r in recs])


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


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plain", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--faults", type=int, default=3, help="faults per in-memory path (collective, stall)")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--tiny", default="decoder")
    parser.add_argument("--large", default="gpt100m")
    parser.add_argument("--data-timeout", type=float, default=None,
                        help="the data-path timeout of the trials (default: the trials' own)")
    parser.add_argument("--paths", default=",".join(PATHS))
    parser.add_argument("--peer-copy-depth", type=int, default=2, choices=(1, 2),
                        help="committed steps kept of each peer copy and own snapshot")
    args = parser.parse_args(argv)
    if args.plain:
        plain_rank(args.plain, args.steps, args.out)
        return {}
    paths = [p for p in args.paths.split(",") if p]
    bad = [p for p in paths if p not in PATHS]
    if bad:
        parser.error(f"--paths takes {', '.join(PATHS)}; got {', '.join(bad)}")
    root = Path(tempfile.mkdtemp(prefix="meshpact-bench-scale-"))
    plain = {w: run_plain(w, args.ranks, args.steps) for w in (args.tiny, args.large)}
    runs: list[PathRun] = []
    for w in (args.tiny, args.large):
        ref = root / f"ref-{w}" / "reference"
        for path in paths:
            runs.append(run_path(w, path, args.ranks, args.steps, args.data_timeout, ref, root, args.faults,
                                 args.peer_copy_depth))
            print(f"# {w} {path}: {runs[-1]}", file=sys.stderr, flush=True)
    state_mb = {w: plain[w].state_bytes / 2**20 for w in plain}
    in_memory = [p for p in paths if POLICY[p] == "in_memory"]
    rec = {w: _p50([ms for r in runs if r.workload == w and r.path in in_memory for ms in r.own_ms]) for w in plain}
    det = {w: _p50([ms for r in runs if r.workload == w and r.path in in_memory for ms in r.skew_ms]) for w in plain}
    extra = {f"{r.workload}/{r.path}": ((r.peak_rss_bytes - plain[r.workload].peak_rss_bytes)
                                        / plain[r.workload].state_bytes if r.peak_rss_bytes else None) for r in runs}
    result = {
        "bench": "scale",
        "ranks": args.ranks, "steps": args.steps, "faults_per_in_memory_path": args.faults,
        "peer_copy_depth": args.peer_copy_depth,
        "data_timeout_s": args.data_timeout,
        "state_mb_per_rank": {w: round(v, 3) for w, v in state_mb.items()},
        "recovery_ms_p50_by_state_mb": {f"{state_mb[w]:.3f}": rec[w] for w in plain},
        "recovery_ratio_large_over_tiny": (rec[args.large] / rec[args.tiny]) if rec[args.large] and rec[args.tiny] else None,
        "skew_ms_p50_by_state_mb": {f"{state_mb[w]:.3f}": det[w] for w in plain},
        "plain_peak_rss_mb": {w: plain[w].peak_rss_bytes / 2**20 for w in plain},
        "plain_step_s_p50": {w: plain[w].step_s_p50 for w in plain},
        "extra_rss_per_rank_over_state": extra,
        "commit_overhead_ms": {f"{r.workload}/{r.path}": r.commit_ms for r in runs if r.path == "collective"},
        "peer_copy_step_latency": {f"{r.workload}/{r.path}": r.step_latency for r in runs if r.path == "collective"},
        "paths": {f"{r.workload}/{r.path}": {"bit_identical": r.bit_identical, "recovered_by_policy": r.policy_count,
                                             "unplanned_recoveries": r.unplanned, "peak_rss_mb": r.peak_rss_bytes / 2**20,
                                             "recovery_ms": r.recovery_ms, "own_ms": r.own_ms, "skew_ms": r.skew_ms,
                                             "stages_ms": r.stages_ms,
                                             "error": r.error} for r in runs},
    }
    print(f"{'workload/path':<22} {'bit-id':>6} {'policy':>6} {'unplanned':>9} {'recovery ms':>12} {'skew ms':>8} "
          f"{'peak RSS MB':>11} {'extra/state':>11}")
    for r in runs:
        key = f"{r.workload}/{r.path}"
        x = extra[key]
        own = _p50(r.own_ms)
        print(f"{key:<22} {str(r.bit_identical):>6} {r.policy_count:>6} {r.unplanned:>9} "
              f"{(own if own is not None else float('nan')):>12.1f} {(_p50(r.skew_ms) or float('nan')):>8.1f} "
              f"{r.peak_rss_bytes / 2**20:>11.0f} "
              f"{(x if x is not None else float('nan')):>11.2f}" + (f"  {r.error}" if r.error else ""))
    for w in plain:
        print(f"plain {w}: peak RSS {plain[w].peak_rss_bytes / 2**20:.0f} MB, state {state_mb[w]:.1f} MB per rank, "
              f"step {plain[w].step_s_p50:.2f} s")
    print(f"in-memory recovery p50 (skew apart): {rec}; skew p50: {det}; large/tiny: "
          f"{result['recovery_ratio_large_over_tiny']}; load average {os.getloadavg()}")
    shutil.rmtree(root, ignore_errors=True)
    emit("scale" if args.peer_copy_depth == 2 else f"scale-depth{args.peer_copy_depth}", result)
    return result


if __name__ == "__main__":
    main()
