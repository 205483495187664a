"""Control-plane scale: the heartbeat's and consensus' store work at N light ranks.

N simulated ranks run the project's own heartbeat looks and consensus against one real control
channel server (a ``TCPStore`` hosted by :func:`~meshpact.live.store.host_store` in a process of
its own, so its CPU is its own). A light rank is a thread with its own
:class:`~meshpact.live.recovery.control.ControlChannel` connection, no model and no data path;
the threads live in a few processes. Each N runs two phases:

| phase | what every light rank does | measured |
|---|---|---|
| heartbeat | for ``--beat-s`` seconds, a look every ``heartbeat_interval_s``: beat its counter, read the counters of the peers it watches (:func:`~meshpact.live.recovery.heartbeat.watched_peers`; ``--watch all`` reads every rank's, as the heartbeat did before) | keys the store touched per rank per look and per second at the configured interval; the looks the simulation achieved; the server's CPU |
| decision | one rank's collective raised: the bench says so to every rank at one instant (``go/agree``), and each runs :func:`~meshpact.live.recovery.consensus.agree` as the live pipeline does (the view taken at its session's start, the counter moves after) | that instant -> every rank holds the decision (ms); the last rank knowing of the fault -> every rank holding the decision (ms: the consensus' own time, without the bench's fan-out of the news); bytes each rank read from the store |

The server's CPU per request in the heartbeat phase (``server_us_per_request_heartbeat``) says
whether the store's cost per request holds as connections grow. The keys a look touches are counted at the store client (a ``multi_get`` of k keys counts k), so
they are the design's cost whatever this 2-core machine manages; the achieved look rate says how
far the simulation itself kept up (thousands of Python threads on two cores do not).

    python bench/control_scale.py                       # N = 64, 256, 1024, 4096; table + JSON line
    python bench/control_scale.py --ranks 64,256 --watch all
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

INTERVAL_S = 0.05  # RecoveryConfig's heartbeat_interval_s default
RUN_ID = "control-scale"


class Counted:
    """A store client that counts the keys each call touches and the bytes it reads back."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self.keys = 0
        self.calls = 0  # requests sent to the store (a multi_get of k keys is one)
        self.bytes_read = 0
        self.proposed_at: float | None = None  # time.time() once this rank's first proposal is stored

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self._store, name)
        if not callable(fn):
            return fn

        def call(*args: Any, **kw: Any) -> Any:
            first = args[0] if args else None
            self.keys += len(first) if isinstance(first, list) else 1
            self.calls += name != "set_timeout"  # the client's own setting: no request
            out = fn(*args, **kw)
            if name == "set" and self.proposed_at is None and "/round" in str(first):
                self.proposed_at = time.time()
            if isinstance(out, (bytes, bytearray)):
                self.bytes_read += len(out)
            elif isinstance(out, list):
                self.bytes_read += sum(len(v) for v in out if isinstance(v, (bytes, bytearray)))
            return out

        return call


def _server(port_file: str) -> None:
    from meshpact.live.store import host_store

    store = host_store("127.0.0.1", 0, 1, timeout_s=600)
    Path(port_file).write_text(str(store.port))
    sys.stdin.read()  # until the bench closes our stdin


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _worker(port: int, world: int, ranks: list[int], beat_s: float, watch_all: bool, timeout_s: float) -> None:
    """A process of light ranks: one thread each; prints one JSON line per rank at the end."""
    from meshpact.live.recovery import jobkey
    from meshpact.live.recovery.consensus import GENERATION_KEY, ROUND_KEY, Proposal, agree
    from meshpact.live.recovery.control import ControlChannel
    from meshpact.live.recovery.heartbeat import PROGRESS, beat_key, watched_peers

    key = jobkey.load(os.environ, RUN_ID, multi_host=True)  # the bench's key, from its environment

    threading.stack_size(512 * 1024)
    members = tuple(range(world))
    out: dict[int, dict[str, Any]] = {}
    cpu: list[float] = []  # this process's CPU seconds as its ranks learn of the fault and hold the decision

    def rank_main(me: int) -> None:
        ch = ControlChannel(
            "127.0.0.1", port, me, world, timeout_s, is_host=False, connect_timeout_s=timeout_s, run_id=RUN_ID, key=key
        )
        counted = Counted(ch._store)
        ch._store = counted
        ch.add("ready")
        ch.wait(["go/heartbeat"], timeout_s)
        peers = tuple(r for r in members if r != me) if watch_all else watched_peers(me, members)
        keys = [beat_key(r) for r in peers]
        looks, k0, c0 = 0, counted.keys, counted.calls
        start = time.monotonic()
        while time.monotonic() - start < beat_s:
            ch.add(beat_key(me), 1 + PROGRESS)
            ch.counters(keys)
            looks += 1
            time.sleep(max(0.0, start + looks * INTERVAL_S - time.monotonic()))
        beat_keys, beat_calls = counted.keys - k0, counted.calls - c0
        ch.add("beaten")
        # a recovery's first round starts from the view the rank took at its session's start (the live
        # pipeline's view=), and leaves the round's two counter moves until after it runs again
        last_round, generation = ch.counters([ROUND_KEY, GENERATION_KEY])
        t0 = float(ch.wait(["go/agree"], timeout_s)["go/agree"])
        knew = time.time()
        cpu.append(time.process_time())
        b0 = counted.bytes_read
        got = agree(
            ch,
            lambda g: Proposal(me, g, 7, "d", True),
            lambda limit: 0,
            timeout_s=timeout_s,
            max_rounds=1,
            replacement_rounds=0,
            view=(last_round, generation),
            defer_counters=True,
        )
        decided = time.time()
        cpu.append(time.process_time())
        if got.counters is not None:  # what the rank makes once it runs again: off the path timed
            got.counters.make(ch)
        decision = got.decision
        out[me] = {
            "rank": me,
            "looks": looks,
            "keys_per_look": beat_keys / max(looks, 1),
            "beat_requests": beat_calls,
            "decided_ms": (decided - t0) * 1e3,
            "knew_ms": (knew - t0) * 1e3,
            "proposed_ms": ((counted.proposed_at or knew) - t0) * 1e3,
            "decision_bytes": counted.bytes_read - b0,
            "policy": decision.policy.value,
        }

    threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s * 3)
    for r in ranks:
        print(json.dumps(out.get(r, {"rank": r, "error": "did not finish"})), flush=True)
    print(json.dumps({"process_cpu_s_decision": max(cpu) - min(cpu) if cpu else 0.0}), flush=True)


def _median(xs: list[float]) -> float | None:
    return round(statistics.median(xs), 3) if xs else None


def run_size(world: int, procs: int, beat_s: float, watch_all: bool, timeout_s: float) -> dict[str, Any]:
    """One N: a server process, ``procs`` processes of light ranks, both phases."""
    import tempfile

    from meshpact.live.recovery import jobkey
    from meshpact.live.recovery.control import ControlChannel

    key = jobkey.draw()  # signed values, as a job's: the light ranks get it through their environment
    env = {**os.environ, jobkey.KEY_ENV: key.secret.hex()}
    with tempfile.TemporaryDirectory() as tmp:
        port_file = Path(tmp) / "port"
        server = subprocess.Popen([sys.executable, __file__, "--server", str(port_file)], stdin=subprocess.PIPE)
        workers: list[subprocess.Popen[str]] = []
        try:
            deadline = time.monotonic() + 60
            while not port_file.exists() or not port_file.read_text():
                if time.monotonic() > deadline or server.poll() is not None:
                    raise RuntimeError("the control channel server did not start")
                time.sleep(0.05)
            port = int(port_file.read_text())
            lead = ControlChannel("127.0.0.1", port, -1, world, timeout_s, is_host=False, run_id=RUN_ID, key=key)
            slices = [list(range(world))[i::procs] for i in range(procs)]
            flag = ["--watch-all"] if watch_all else []
            workers = [
                subprocess.Popen(
                    [
                        sys.executable,
                        __file__,
                        "--worker",
                        str(port),
                        str(world),
                        ",".join(map(str, s)),
                        str(beat_s),
                        str(timeout_s),
                        *flag,
                    ],
                    stdout=subprocess.PIPE,
                    text=True,
                    env=env,
                )
                for s in slices
            ]
            deadline = time.monotonic() + timeout_s
            while lead.counter("ready") < world:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"only {lead.counter('ready')} of {world} light ranks connected")
                time.sleep(0.1)
            cpu0 = _cpu_s(server.pid)
            lead.set("go/heartbeat", True)
            while lead.counter("beaten") < world:
                if time.monotonic() > deadline + beat_s:
                    raise RuntimeError("the heartbeat phase did not end")
                time.sleep(0.05)
            cpu_beat = _cpu_s(server.pid) - cpu0
            cpu1 = _cpu_s(server.pid)
            lead.set("go/agree", time.time())
            rows = []
            for w in workers:
                try:
                    text, _ = w.communicate(timeout=max(deadline + 3 * timeout_s - time.monotonic(), 1.0))
                except subprocess.TimeoutExpired:
                    return {
                        "ranks": world,
                        "error": f"the decision phase ran past its bound of {3 * timeout_s:g} s "
                        f"({world} light ranks on {os.cpu_count()} cores)",
                    }
                rows += [json.loads(line) for line in text.splitlines() if line.startswith("{")]
            cpu_agree = _cpu_s(server.pid) - cpu1
        finally:
            for w in workers:
                if w.poll() is None:
                    w.kill()
            server.stdin.close()  # type: ignore[union-attr]  # started with stdin=PIPE
            server.wait(timeout=30)
    client_cpu = sum(r.pop("process_cpu_s_decision") for r in rows if "process_cpu_s_decision" in r)
    rows = [r for r in rows if "rank" in r]
    done = [r for r in rows if "error" not in r]
    if len(done) < world:
        return {"ranks": world, "error": f"{world - len(done)} light rank(s) did not finish"}
    per_look = statistics.mean(r["keys_per_look"] for r in done)
    known = max(r["knew_ms"] for r in done)
    achieved = statistics.mean(r["looks"] for r in done) / beat_s
    return {
        "ranks": world,
        "keys_per_look": round(per_look, 2),
        "heartbeat_keys_per_rank_per_s": round(per_look / INTERVAL_S, 1),
        "heartbeat_keys_total_per_s": round(per_look / INTERVAL_S * world, 0),
        "looks_achieved_per_rank_per_s": round(achieved, 2),
        "server_cpu_s_per_s_heartbeat": round(cpu_beat / beat_s, 3),
        "server_us_per_request_heartbeat": round(cpu_beat / max(sum(r["beat_requests"] for r in done), 1) * 1e6, 1),
        "decision_ms_all_ranks": round(max(r["decided_ms"] for r in done), 1),
        "decision_ms_p50_rank": _median([r["decided_ms"] for r in done]),
        "decision_ms_after_known": round(max(r["decided_ms"] for r in done) - known, 1),
        "knew_ms_all_ranks": round(known, 1),
        "proposed_ms_all_ranks": round(max(r["proposed_ms"] for r in done), 1),
        "decision_bytes_per_rank": round(statistics.mean(r["decision_bytes"] for r in done), 0),
        "decision_bytes_max_rank": max(r["decision_bytes"] for r in done),
        "server_cpu_s_decision": round(cpu_agree, 3),
        # the light ranks' own CPU from the first learning of the fault to the last holding the decision, per
        # rank: on a cluster each rank spends it on its own host; here every rank's shares two cores
        "client_cpu_ms_per_rank_decision": round(client_cpu / world * 1e3, 3),
        "client_cpu_bound_ms": round(client_cpu / (os.cpu_count() or 1) * 1e3, 1),
        "policies": sorted({r["policy"] for r in done}),
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--server":
        _server(argv[1])
        return 0
    if argv and argv[0] == "--worker":
        port, world, ranks, beat_s, timeout_s = argv[1:6]
        _worker(
            int(port),
            int(world),
            [int(r) for r in ranks.split(",") if r],
            float(beat_s),
            "--watch-all" in argv,
            float(timeout_s),
        )
        return 0
    parser = argparse.ArgumentParser(
        description="control-plane scale: heartbeat and consensus store work at N light ranks"
    )
    parser.add_argument("--ranks", default="64,256,1024,4096", help="comma-separated N (default: %(default)s)")
    parser.add_argument("--procs", type=int, default=8, help="processes the light ranks are spread over")
    parser.add_argument("--beat-s", type=float, default=3.0, help="seconds of heartbeat looks per N")
    parser.add_argument("--repeats", type=int, default=1, help="runs per N (the figures are medians)")
    parser.add_argument(
        "--watch",
        choices=("ring", "all"),
        default="ring",
        help="ring: the heartbeat's watched_peers; all: every rank's counter, as before",
    )
    parser.add_argument("--timeout-s", type=float, default=120.0, help="bound on each phase")
    args = parser.parse_args(argv)
    try:
        sizes = [int(x) for x in args.ranks.split(",")]
        if any(n < 2 for n in sizes):
            raise ValueError
    except ValueError:
        parser.error(f"--ranks {args.ranks!r}: expected comma-separated integers of 2 or more")
    from _results import emit

    by: dict[int, list[dict[str, Any]]] = {}
    for n in sizes:
        for _ in range(args.repeats):
            try:
                got = run_size(n, args.procs, args.beat_s, args.watch == "all", args.timeout_s)
            except RuntimeError as exc:  # a size past what this machine simulates: said in its row, the others kept
                got = {"ranks": n, "error": str(exc)}
            by.setdefault(n, []).append(got)
            print(f"# N={n}: {by[n][-1]}", file=sys.stderr, flush=True)

    def med(n: int, key: str) -> Any:
        xs = [r[key] for r in by[n] if key in r]
        return _median(xs) if xs and isinstance(xs[0], (int, float)) else (xs[0] if xs else None)

    keys = (
        "keys_per_look",
        "heartbeat_keys_per_rank_per_s",
        "heartbeat_keys_total_per_s",
        "looks_achieved_per_rank_per_s",
        "server_cpu_s_per_s_heartbeat",
        "decision_ms_all_ranks",
        "decision_ms_after_known",
        "client_cpu_bound_ms",
        "server_us_per_request_heartbeat",
        "decision_bytes_per_rank",
        "server_cpu_s_decision",
    )
    print("| N | " + " | ".join(keys) + " |\n|" + "---|" * (len(keys) + 1))
    for n in sizes:
        print(f"| {n} | " + " | ".join(str(med(n, k)) for k in keys) + " |")
    doc = {
        "watch": args.watch,
        "interval_s": INTERVAL_S,
        "beat_s": args.beat_s,
        "procs": args.procs,
        "repeats": args.repeats,
        "decision_ms_p50_by_ranks": {str(n): med(n, "decision_ms_all_ranks") for n in sizes},
        "decision_ms_after_known_by_ranks": {str(n): med(n, "decision_ms_after_known") for n in sizes},
        "client_cpu_bound_ms_by_ranks": {str(n): med(n, "client_cpu_bound_ms") for n in sizes},
        "server_us_per_request_by_ranks": {str(n): med(n, "server_us_per_request_heartbeat") for n in sizes},
        "heartbeat_ops_per_s_by_ranks": {str(n): med(n, "heartbeat_keys_per_rank_per_s") for n in sizes},
        "decision_bytes_per_rank_by_ranks": {str(n): med(n, "decision_bytes_per_rank") for n in sizes},
        "runs": {str(n): by[n] for n in sizes},
    }
    emit("control_scale" if args.watch == "ring" else "control_scale-watch-all", doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
