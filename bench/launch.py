"""``meshpact launch`` against ``torchrun --max-restarts 1`` on two namespace nodes x two ranks.

One run, side by side, on network namespaces on one bridge (:class:`~meshpact.live.netns.Hosts`:
one launcher per node, node 0 hosting elastic's c10d rendezvous, a third namespace for the spare
node), each case a fresh job of ``examples/resilient_train.py``:

| case | launcher | fault (after rank 3 committed step KILL_AT) |
|---|---|---|
| ``worker_kill_warm_spare`` | meshpact launch, ``--spare-ranks-per-node 1`` | SIGKILL rank 3 (node 1) |
| ``worker_kill_cold`` | meshpact launch | SIGKILL rank 3 |
| ``node_kill`` | meshpact launch, ``--excise-to 2`` in the script | SIGKILL node 1's agent and both its workers |
| ``node_kill_spare_node`` | meshpact launch, a third node's agent started with ``--spare`` | SIGKILL node 1's agent and both its workers: the spare node takes ranks 2 and 3 |
| ``torchrun_restart`` | torchrun ``--max-restarts 1``, a checkpoint every 5 steps | SIGKILL rank 3: torchrun restarts every worker, which load the newest checkpoint |

Downtime is read from the job's own progress: from the kill until every remaining rank has
committed the step after the one rank 3 had committed (``steps-rank<r>.log``), so it counts
detection, recovery, any process start and one step, whatever the launcher did. Bit-identity
compares every rank's final state digest with plain torchrun on one node without a fault; an
excision leaves a smaller world, so the node kill's survivors are compared with the excising
reference instead (:mod:`meshpact.live.trials.launchref`: the same job with ranks 2 and 3
leaving at the step the survivors excised them, no fault, under plain torchrun).
Storage bytes read are the checkpoint bytes the job's processes read. ``survivor_pids_kept``:
every rank not killed ended in the process it started in.

    python bench/launch.py            # table + one JSON line, also bench/results/launch.json
    python bench/launch.py --repeat 5 --busy-loops 2 --cases worker_kill_warm_spare,worker_kill_cold,node_kill,node_kill_spare_node

``--repeat N`` runs every case N times in a row (the figures are the runs' medians, and
``passed_by_case`` counts the runs that ended well: every launcher exited 0, bit-identical, the
survivors' processes kept); ``--busy-loops K`` keeps K processes spinning (``while 1: pass``)
beside the jobs for the whole run, as a loaded machine would. Such a run is written to
``bench/results/launch-load.json``, beside the plain run's.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _results import emit  # noqa: E402

from meshpact.live.netns import Hosts, bridge_unavailable  # noqa: E402
from meshpact.live.trials.launchdrill import Job, excised_at, excising_reference, read_finals, resumed_at  # noqa: E402

STEPS, STEP_S, KILL_AT, KILLED = 16, 0.05, 5, 3
SPARE_READY = "is ready ("  # the launcher's line once a warm spare has imported what it preloads
CASES = ("worker_kill_warm_spare", "worker_kill_cold", "node_kill", "node_kill_spare_node", "torchrun_restart")
NODE_KILLS = ("node_kill", "node_kill_spare_node")
SPARE_HOST = 2


def _flags(hosts: Hosts, node: int, port: int, run: str) -> list[str]:
    return [
        "--nnodes",
        "2",
        "--nproc-per-node",
        "2",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"{hosts.addr[0]}:{port}",
        "--rdzv-id",
        run,
        "--rdzv-conf",
        f"is_host={int(node == 0)}",
        "--local-addr",
        hosts.addr[node],
    ]


def run_case(case: str, hosts: Hosts, work: Path, port: int, reference: dict[int, str]) -> dict[str, Any]:
    out = work / case
    torchrun = case == "torchrun_restart"
    script: tuple[str, ...] = ("--excise-to", "2") if case == "node_kill" else ()
    if torchrun:
        script = ("--checkpoint-dir", str(work / "checkpoints"), "--checkpoint-every", "5")
    jobs, key = [], Job.key_env()  # one key for the job's nodes (and its spare node)
    for node in (0, 1):
        flags = _flags(hosts, node, port, f"{case}{hosts.tag}")
        if torchrun:
            launcher = Job.torchrun(*flags, "--max-restarts", "1")
            # what meshpact launch sets by itself (each attempt keeps its own keys in the agents' shared
            # store by itself: session.run_id_of)
            env = {
                "GLOO_SOCKET_IFNAME": hosts.iface[node],
                "MESHPACT_PEER_ADDR": hosts.addr[node],
                "MESHPACT_HOST_ID": f"node{node}",
                **key,
            }
        else:
            extra = ["--spare-ranks-per-node", "1"] if case == "worker_kill_warm_spare" and node == 1 else []
            launcher = Job.meshpact(*flags, "--max-restarts", "1", "--node-loss-s", "3", *extra)
            env = dict(key)
        jobs.append(
            Job(
                launcher, out, STEPS, STEP_S, prefix=hosts.prefix(node), env=env, name=f"node{node}", script_args=script
            )
        )
    if case == "node_kill_spare_node":
        jobs.append(
            Job(
                Job.meshpact(*_flags(hosts, SPARE_HOST, port, f"{case}{hosts.tag}"), "--node-loss-s", "3", "--spare"),
                out,
                STEPS,
                STEP_S,
                prefix=hosts.prefix(SPARE_HOST),
                env=key,
                name="spare",
            )
        )
    node0, node1 = jobs[:2]
    try:
        first = {r: (node0 if r < 2 else node1).wait_for_step(r, 0, 300) for r in range(4)}
        if case == "worker_kill_warm_spare":  # killed once the spare is warm: its imports done
            node1.wait_for_log(SPARE_READY, 300)
        if case == "node_kill_spare_node":  # killed once node 0 knows the spare node
            node0.wait_for_log(f"at {hosts.addr[SPARE_HOST]} registered", 300)
        victim = node1.wait_for_step(KILLED, KILL_AT, 300)
        if case in NODE_KILLS:
            node1.kill_agent_and([node1.wait_for_step(r, KILL_AT, 60) for r in (2, 3)])
        else:
            node1.kill_rank(KILLED, KILL_AT)
        t_kill = time.time()
        rc0 = node0.wait(300)
        rc1 = node1.wait(300) if case not in NODE_KILLS else jobs[2].wait(300) if len(jobs) > 2 else 0
    finally:
        for job in jobs:
            job.close()
    remaining = (0, 1) if case == "node_kill" else (0, 1, 2, 3)  # the spare node's ranks 2 and 3 remain
    finals = read_finals(out, 4)
    at = resumed_at(out, remaining, victim.step + 1, t_kill)
    survivors = [r for r in remaining if r != KILLED and not (case in NODE_KILLS and r >= 2)]
    if case == "node_kill":
        at_step = {excised_at(finals[r]) for r in remaining if r in finals}
        identical = False
        if sorted(finals) == list(remaining) and len(at_step) == 1 and None not in at_step:
            step = at_step.pop()
            assert step is not None  # ruled out above
            excised = excising_reference(out / "reference", STEPS, step, 4, len(remaining))
            identical = all(finals[r].digest == excised[r].digest for r in remaining if r in excised) and sorted(
                excised
            ) == list(remaining)
    else:
        identical = sorted(finals) == sorted(reference) and all(finals[r].digest == reference[r] for r in finals)
    return {
        "ok": rc0 == 0 and rc1 == 0,
        "downtime_s": None if at is None else round(at - t_kill, 3),
        "storage_bytes_read": sum(f.storage_bytes_read for f in finals.values()),
        "bit_identical": identical,
        "survivor_pids_kept": all(
            r in finals and finals[r].pid == first[r].pid and finals[r].incarnation == 0 for r in survivors
        ),
        "policies": sorted({p for f in finals.values() for p in f.policies}),
    }


def _passed(case: str, r: dict[str, Any]) -> bool:
    """A run ended well: every launcher exited 0, bit-identical, and (meshpact launch) the survivors kept."""
    kept = r["survivor_pids_kept"] or case == "torchrun_restart"  # torchrun restarts every worker by design
    return bool(r["ok"] and r["bit_identical"] and kept and r["downtime_s"] is not None)


def _summary(case: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One case over its runs: the medians, every run's downtime, how many passed, and the worst of the rest."""
    downtimes = [r["downtime_s"] for r in runs if r["downtime_s"] is not None]
    return {
        "ok": all(r["ok"] for r in runs),
        "passed": sum(_passed(case, r) for r in runs),
        "downtime_s": round(statistics.median(downtimes), 3) if downtimes else None,
        "downtime_s_runs": [r["downtime_s"] for r in runs],
        "storage_bytes_read": max(r["storage_bytes_read"] for r in runs),
        "bit_identical": (
            None if all(r["bit_identical"] is None for r in runs) else all(r["bit_identical"] for r in runs)
        ),
        "survivor_pids_kept": all(r["survivor_pids_kept"] for r in runs),
        "policies": sorted({p for r in runs for p in r["policies"]}),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default=",".join(CASES), help=f"a comma list of {', '.join(CASES)}")
    p.add_argument("--keep", default=None, metavar="DIR", help="keep every job's logs and outputs under DIR")
    p.add_argument("--repeat", type=int, default=1, help="runs of every case, one after another")
    p.add_argument("--busy-loops", type=int, default=0, help="processes spinning beside the jobs (load)")
    args = p.parse_args()
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    if not cases or any(c not in CASES for c in cases):
        sys.stderr.write(f"error: --cases {args.cases!r}: expected a comma list of {', '.join(CASES)}\n")
        return 2
    if args.repeat < 1 or args.busy_loops < 0:
        sys.stderr.write(
            f"error: --repeat {args.repeat} --busy-loops {args.busy_loops}: expected a repeat of 1 "
            "or more and 0 or more busy loops\n"
        )
        return 2
    why = bridge_unavailable()
    if why:
        sys.stderr.write(f"error: bench/launch.py needs network namespaces: {why}\n")
        return 2
    with tempfile.TemporaryDirectory(prefix="meshpact-bench-launch-") as tmp:
        work = Path(args.keep) if args.keep else Path(tmp)
        with Job(Job.torchrun("--standalone", "--nproc-per-node", "4"), work / "reference", STEPS) as ref:
            if ref.wait(300) != 0:
                sys.stderr.write(f"error: the fault-free reference failed:\n{ref.tail()}\n")
                return 1
        reference = {r: f.digest for r, f in read_finals(work / "reference", 4).items()}
        runs: dict[str, list[dict[str, Any]]] = {c: [] for c in cases}
        busy = [subprocess.Popen([sys.executable, "-c", "while 1: pass"]) for _ in range(args.busy_loops)]
        try:
            with Hosts(3) as hosts:
                for n in range(args.repeat):
                    for i, case in enumerate(cases):
                        r = run_case(case, hosts, work / f"run{n}", 29400 + (n * len(cases) + i) % 500, reference)
                        runs[case].append(r)
                        if args.repeat > 1:
                            sys.stderr.write(f"run {n + 1}/{args.repeat} {case}: {r}\n")
        finally:
            for proc in busy:
                proc.kill()
                proc.wait()
        results = {c: _summary(c, rs) for c, rs in runs.items()}
    print(
        f"{'case':<24} {'ok':<5} {'downtime s':>10} {'storage B read':>15} {'bit-identical':>14} "
        f"{'survivor pids kept':>19}  policies"
    )
    for case, r in results.items():
        print(
            f"{case:<24} {str(r['ok']):<5} {str(r['downtime_s']):>10} {r['storage_bytes_read']:>15} "
            f"{str(r['bit_identical']):>14} {str(r['survivor_pids_kept']):>19}  {', '.join(r['policies'])}"
        )
    spare = results.get("worker_kill_warm_spare", {}).get("downtime_s")
    restart = results.get("torchrun_restart", {}).get("downtime_s")
    # a run under load (or repeated) is a result of its own: bench/results/launch-load.json
    emit(
        "launch" if args.repeat == 1 and args.busy_loops == 0 else "launch-load",
        {
            "bench": "launch",
            "runs": args.repeat,
            "busy_loops": args.busy_loops,
            "passed_by_case": {c: r["passed"] for c, r in results.items()},
            "downtime_s_runs_by_case": {c: r["downtime_s_runs"] for c, r in results.items()},
            "nodes": 2,
            "ranks_per_node": 2,
            "steps": STEPS,
            "kill_after_step": KILL_AT,
            "step_sleep_s": STEP_S,
            "downtime_s_by_case": {c: r["downtime_s"] for c, r in results.items()},
            "storage_bytes_read_by_case": {c: r["storage_bytes_read"] for c, r in results.items()},
            "bit_identical_by_case": {c: r["bit_identical"] for c, r in results.items()},
            "survivor_pids_kept": {c: r["survivor_pids_kept"] for c, r in results.items()},
            "ok_by_case": {c: r["ok"] for c, r in results.items()},
            "policies_by_case": {c: r["policies"] for c, r in results.items()},
            "warm_spare_over_torchrun_restart": round(spare / restart, 3) if spare and restart else None,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
