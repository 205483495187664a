"""Fault to fault against torchft: the same model, world and injected allreduce error, timed from
the fault to every rank's next committed step.

One run on this machine, side by side:

| side | how it trains | the fault |
|---|---|---|
| meshpact | ``torchrun --standalone``, ``start_session`` + ``resilient`` around FSDP2 (``fully_shard`` over the world) | at step ``--fault-step``, rank 1's first collective raises (``FaultInjector``, kind ``collective``) |
| torchft | torchft 0.2.0's ``Manager`` with one replica group per rank (its Lighthouse on loopback, ``ProcessGroupGloo``), ``Manager.allreduce`` averaging each gradient (torchft's ``DistributedDataParallel`` hook fails on the error path itself: ``assert fut._fut`` in ``torchft/ddp.py`` once the manager has errored) | at step ``--fault-step``, replica 1's gradient allreduce raises before it reaches gloo, as meshpact's does (``torchft``); and, apart, torchft's own injection, which lets the allreduce complete on the wire and fails only replica 1's future (``torchft_error_after_wire``: the peers never wait) |

Both train the same model from the same seed on the same batches (``batch(step, rank)``), each
with AdamW. Each rank writes the wall time of every committed step; **fault to running** is
the time from the injection until every rank has committed a step after it (meshpact runs the
failed step again; torchft's other replicas commit it, and the failed one heals from a peer and
commits the next). Both sides' data paths time out after 10 s. Each side also runs once without the fault: ``state_equal`` says whether
every rank's final parameters equal that run's, bit for bit; ``world_after`` how many ranks the
job ends with. Every figure is a median over ``--repeat`` runs.

    python bench/faults_vs_torchft.py               # table + one JSON line, also bench/results/faults_vs_torchft.json
    python bench/faults_vs_torchft.py --repeat 5 --ranks 4

torchft is the bench extra (``pip install -e '.[bench]'``); without it the torchft side says so
in one line and the bench still measures meshpact's.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
STEPS = 12
FAULT_STEP = 5
DIM, HIDDEN, BATCH = 32, 64, 8


def _model() -> Any:
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(DIM, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, DIM))


def _batch(step: int, rank: int) -> Any:
    import torch

    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(BATCH, DIM, generator=g), torch.randn(BATCH, DIM, generator=g)


def _loss(model: Any, b: Any) -> Any:
    x, y = b
    return ((model(x) - y) ** 2).mean()


def _write(out: Path, rank: int, rows: list[dict[str, Any]], final: list[Any]) -> None:
    import torch

    torch.save({"rows": rows, "final": [t.detach().clone() for t in final]}, out / f"rank{rank}.pt")


def meshpact_rank(out: Path, steps: int, fault_step: int | None) -> None:
    """One rank under torchrun: FSDP2 over the world, the collective fault at ``fault_step``."""
    import torch
    from torch.distributed.fsdp import fully_shard

    from meshpact.live.recovery import resilient, start_session
    from meshpact.live.recovery.config import RecoveryConfig
    from meshpact.live.recovery.faults import Fault, FaultInjector, FaultKind

    session = start_session(RecoveryConfig(data_timeout_s=10.0, checkpoint_dir=None, peer_copies=0))
    model = _model()
    fully_shard(model, mesh=session.mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    faults = (Fault(0, FaultKind.COLLECTIVE, fault_step, 1),) if fault_step is not None else ()
    injector = FaultInjector(faults, session.rank, session.control)
    rows: list[dict[str, Any]] = []

    def train_step(b: Any) -> float:
        loss = _loss(model, b)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return float(loss)

    with resilient(model, opt, session, injector, batches=lambda s: _batch(s, session.rank)) as rt:
        for step in range(rt.start_step, steps):
            rt.step(train_step, _batch(step, session.rank))
            rows.append({"step": step, "t": time.time(), "generation": rt.generation})
    fault = session.control.get("fault/0") if fault_step is not None else None
    if fault is not None:
        rows.append({"fault_t": fault["t_wall"]})
    full = [p.full_tensor() for p in model.parameters()]
    _write(out, session.rank, rows + [{"world": len(session.members)}], full)


def _FailedWork(message: str) -> Any:
    """A collective's handle that failed before any byte left: its future holds the error (torchft's Manager
    reads collectives' outcomes through their futures)."""
    import torch
    import torch.distributed as dist

    class Failed(dist._Work):
        def __init__(self) -> None:
            super().__init__()
            self.future_: Any = torch.futures.Future()
            self.future_.set_exception(RuntimeError(message))

        def wait(self, timeout: Any = None) -> bool:
            raise RuntimeError(message)

        def get_future(self) -> Any:
            return self.future_

    return Failed()


def torchft_replica(
    out: Path,
    replica: int,
    replicas: int,
    lighthouse: str,
    steps: int,
    fault_step: int | None,
    before_backend: bool = True,
) -> None:
    """One replica group of one rank: torchft's Manager, its DDP, the allreduce error at ``fault_step``."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torchft.manager import Manager
    from torchft.process_group import FakeProcessGroupWrapper, ProcessGroupGloo

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    pg = FakeProcessGroupWrapper(ProcessGroupGloo(timeout=timedelta(seconds=10)))
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": opt.state_dict()}

    def load_state_dict(sd: dict[str, Any]) -> None:
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optim"])

    manager = Manager(
        pg=pg,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=replicas,
        replica_id=f"replica{replica}",
        store_addr="127.0.0.1",
        store_port=store.port,
        rank=0,
        world_size=1,
        lighthouse_addr=lighthouse,
        hostname="127.0.0.1",
        timeout=timedelta(seconds=10),
        quorum_timeout=timedelta(seconds=30),
    )
    rows: list[dict[str, Any]] = []
    fired = False
    try:
        while manager.current_step() < steps:
            step = manager.current_step()
            opt.zero_grad()
            manager.start_quorum()
            if fault_step is not None and replica == 1 and step == fault_step and not fired:
                fired = True
                rows.append({"fault_t": time.time()})
                if before_backend:  # the next allreduce fails before gloo sees it: the peers wait in theirs
                    inner, armed = pg.allreduce, [True]

                    def allreduce(tensors: Any, opts: Any, inner: Any = inner, armed: list[bool] = armed) -> Any:
                        if armed[0]:
                            armed[0] = False
                            return _FailedWork("injected: allreduce failed before reaching the backend")
                        return inner(tensors, opts)

                    pg.allreduce = allreduce
                else:
                    pg.report_future_error(RuntimeError("injected allreduce error"))
            loss = _loss(model, _batch(step, replica))
            loss.backward()
            # every gradient averaged over the replicas, one at a time: a failed allreduce is seen at its wait,
            # after which the manager's allreduces are no-ops (issued all at once, the failed replica's later
            # ones would pair with its peers' earlier ones on the wire); should_commit() then says no, and the
            # step is skipped, which is torchft's way through a fault
            for p in model.parameters():
                if p.grad is not None:
                    manager.allreduce(p.grad).wait()
            if manager.should_commit():
                opt.step()
                rows.append({"step": step, "t": time.time(), "replicas": manager.num_participants()})
        _write(out, replica, rows + [{"world": manager.num_participants()}], list(model.parameters()))
    finally:
        manager.shutdown(wait=False)


def _read(out: Path, n: int) -> list[dict[str, Any]]:
    import torch

    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(n)]


def _fault_to_running(ranks: list[dict[str, Any]]) -> float | None:
    faults = [row["fault_t"] for r in ranks for row in r["rows"] if "fault_t" in row]
    if not faults:
        return None
    t0 = min(faults)
    firsts = []
    for r in ranks:
        after = [row["t"] for row in r["rows"] if "t" in row and row["t"] > t0]
        if not after:
            return None
        firsts.append(min(after))
    return (max(firsts) - t0) * 1e3


def _equal(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> bool:
    import torch

    return all(
        len(x["final"]) == len(y["final"]) and all(torch.equal(p, q) for p, q in zip(x["final"], y["final"]))
        for x, y in zip(a, b)
    )


def run_meshpact(n: int, steps: int, fault_step: int | None, timeout_s: float) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={n}",
            __file__,
            "--meshpact-rank",
            tmp,
            str(steps),
            str(-1 if fault_step is None else fault_step),
        ]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
        if done.returncode != 0:
            raise RuntimeError(f"meshpact run failed ({done.returncode}): {done.stderr.strip().splitlines()[-3:]}")
        return _read(Path(tmp), n)


def run_torchft(
    n: int, steps: int, fault_step: int | None, timeout_s: float, before_backend: bool = True
) -> list[dict[str, Any]]:
    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=n, join_timeout_ms=100)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
            procs = [
                subprocess.Popen(
                    [
                        sys.executable,
                        __file__,
                        "--torchft-replica",
                        tmp,
                        str(r),
                        str(n),
                        lighthouse.address(),
                        str(steps),
                        str(-1 if fault_step is None else fault_step),
                        "before" if before_backend else "after",
                    ],
                    env=env,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                    text=True,
                )
                for r in range(n)
            ]
            deadline = time.monotonic() + timeout_s
            errs = []
            for p in procs:
                try:
                    _, err = p.communicate(timeout=max(deadline - time.monotonic(), 1))
                except subprocess.TimeoutExpired:
                    p.kill()
                    _, err = p.communicate()
                if p.returncode != 0:
                    errs.append(err.strip().splitlines()[-1:] if err else [f"exit {p.returncode}"])
            if errs:
                raise RuntimeError(f"torchft run failed: {errs}")
            return _read(Path(tmp), n)
    finally:
        lighthouse.shutdown()


def side(name: str, n: int, steps: int, fault_step: int, repeat: int, timeout_s: float) -> dict[str, Any]:
    runners: dict[str, Callable[..., list[dict[str, Any]]]] = {
        "meshpact": run_meshpact,
        "torchft": run_torchft,
        "torchft_error_after_wire": functools.partial(run_torchft, before_backend=False),
    }
    runner = runners[name]
    reference = runner(n, steps, None, timeout_s)
    downs, equal, worlds = [], [], []
    failed: list[str] = []
    for _ in range(repeat):
        try:
            ranks = runner(n, steps, fault_step, timeout_s)
        except (RuntimeError, subprocess.TimeoutExpired) as exc:  # the job did not survive the fault: data, not a crash
            failed.append(str(exc)[:300])
            continue
        downs.append(_fault_to_running(ranks))
        equal.append(_equal(ranks, reference))
        worlds.append(min(row["world"] for r in ranks for row in r["rows"] if "world" in row))
    ok = [d for d in downs if d is not None]
    return {
        "fault_to_running_ms_p50": round(statistics.median(ok), 1) if ok else None,
        "fault_to_running_ms_runs": [None if d is None else round(d, 1) for d in downs],
        "state_equal_runs": equal,
        "world_after": min(worlds) if worlds else None,
        "ranks": n,
        "runs_failed": failed,
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--meshpact-rank"]:
        fault = int(argv[3])
        meshpact_rank(Path(argv[1]), int(argv[2]), None if fault < 0 else fault)
        return 0
    if argv[:1] == ["--torchft-replica"]:
        fault = int(argv[6])
        torchft_replica(
            Path(argv[1]),
            int(argv[2]),
            int(argv[3]),
            argv[4],
            int(argv[5]),
            None if fault < 0 else fault,
            argv[7] == "before",
        )
        return 0
    parser = argparse.ArgumentParser(description="fault to fault against torchft: an injected allreduce error")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--fault-step", type=int, default=FAULT_STEP)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--timeout-s", type=float, default=300.0)
    args = parser.parse_args(argv)
    if not 2 <= args.ranks <= 16:
        parser.error(f"--ranks {args.ranks}: expected 2 to 16")
    if not 1 <= args.fault_step < args.steps - 1:
        parser.error(f"--fault-step {args.fault_step}: expected 1 to --steps - 2 ({args.steps - 2})")
    sys.path.insert(0, str(ROOT / "bench"))
    from _results import emit

    doc: dict[str, Any] = {
        "steps": args.steps,
        "fault_step": args.fault_step,
        "repeat": args.repeat,
        "meshpact": side("meshpact", args.ranks, args.steps, args.fault_step, args.repeat, args.timeout_s),
    }
    try:
        import torchft  # noqa: F401
    except ImportError as exc:
        doc["torchft"] = {"error": f"torchft is not installed ({exc}); pip install -e '.[bench]'"}
    else:
        doc["torchft"] = side("torchft", args.ranks, args.steps, args.fault_step, args.repeat, args.timeout_s)
        doc["torchft_error_after_wire"] = side(
            "torchft_error_after_wire", args.ranks, args.steps, args.fault_step, args.repeat, args.timeout_s
        )
    m, t = doc["meshpact"].get("fault_to_running_ms_p50"), doc["torchft"].get("fault_to_running_ms_p50")
    doc["ratio_fault_to_running_p50"] = round(m / t, 3) if m and t else None
    print(
        "| side | fault to running p50 (ms) | runs | state equal to fault-free | ranks after |\n|---|---|---|---|---|"
    )
    for name in ("meshpact", "torchft", "torchft_error_after_wire"):
        s = doc.get(name, {})
        print(
            f"| {name} | {s.get('fault_to_running_ms_p50')} | {s.get('fault_to_running_ms_runs', s.get('error'))} | "
            f"{s.get('state_equal_runs')} | {s.get('world_after')} |"
        )
    print(f"ratio meshpact / torchft: {doc['ratio_fault_to_running_p50']}")
    emit("faults_vs_torchft", doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
