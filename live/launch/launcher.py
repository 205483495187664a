"""Launcher: run a worker function on N ranks, each a real process with torchrun's environment.

Each rank is a Python process running ``python -m meshpact.live.launch.launcher --target
module:function``. The environment is the one ``torchrun`` gives (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, ...), so the same entry
point runs unchanged under ``torchrun --nproc-per-node N -m meshpact.live.launch.launcher --target
...`` or ``meshpact launch`` on one host or many.

:func:`launch` runs the ranks under ``meshpact launch``'s agent in this process
(:class:`~meshpact.live.launch.agentjob.AgentJob`, which hosts the rendezvous ``TCPStore`` itself, as
torchrun's agent does: the workers connect as clients, so a rank that dies takes no store with
it) and collects each rank's value. A worker function takes one ``dict`` of JSON arguments and
returns a JSON-serialisable value. Everything stops by itself: a deadline kills every child still
running.
"""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

from ..store import host_store
from .worker import LaunchedProcess, LaunchError, RankResult, _main, write_result

if TYPE_CHECKING:
    from .forkserver import ForkServer

__all__ = [
    "LaunchError",
    "LaunchedProcess",
    "RankResult",
    "launch",
    "host_store",
    "write_result",
]


def launch(
    target: str,
    world_size: int,
    args: Mapping[str, Any] | None = None,
    *,
    timeout_s: float = 120.0,
    check: bool = True,
    env: Callable[[int], Mapping[str, str]] | None = None,
    forkserver: "ForkServer | Callable[[int], ForkServer | None] | None" = None,
    prefix: Callable[[int], Sequence[str]] | None = None,
    master_addr: str = "127.0.0.1",
    master_port: int | None = None,
) -> list[RankResult]:
    """Run ``target`` on ``world_size`` ranks and return every rank's result.

    The ranks run under ``meshpact launch``'s agent (:class:`~meshpact.live.launch.agentjob.AgentJob`, in
    this process; no rank is replaced). ``env(rank)``: more environment for a rank; ``prefix(rank)``:
    a command a rank starts under (``ip netns exec NS``); ``forkserver``: warm first starts (one
    server, or one per rank). The job hosts the ranks' store on loopback, unless ``master_port``
    names one hosted elsewhere (at ``master_addr``). With ``check`` a failed or timed-out rank
    raises :class:`LaunchError` with its stderr.
    """
    from .agentjob import AgentJob

    if master_port is None and master_addr != "127.0.0.1":
        raise LaunchError(
            f"master_addr {master_addr}: the job hosts its store on loopback; a store hosted "
            "elsewhere is named with master_port too"
        )
    master = (master_addr, int(master_port)) if master_port is not None else None
    with AgentJob(
        target, world_size, args, timeout_s=timeout_s, env=env, forkserver=forkserver, prefix=prefix, master=master
    ) as job:
        results = job.run().results
    if check:
        bad = [r for r in results if not r.ok]
        if bad:
            first = bad[0]
            what = "timed out" if first.returncode is None else f"exited with {first.returncode}"
            raise LaunchError(
                f"rank {first.rank} of {target} {what} (limit {timeout_s:.0f} s); its stderr ends:\n{first.stderr_tail}"
            )
    return results


def echo(args: dict) -> dict:
    """A diagnostic worker: joins the rendezvous store and reports its environment. A first
    process of a rank in ``fail_ranks`` exits with 3 at once, a replacement process raises
    ``raise_in_replacement`` when given, and a rank in ``refuse_ranks`` refuses a recovery (for
    replacement tests)."""
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    incarnation = int(os.environ.get("MESHPACT_INCARNATION", "0"))
    if rank in args.get("fail_ranks", ()) and incarnation == 0:
        sys.exit(3)
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world,
        is_master=False,
        timeout=timedelta(seconds=float(args.get("timeout_s", 30))),
    )
    store.add("echo/arrived", 1)
    if rank == 0:
        store.set("echo/go", "1")
    store.wait(["echo/go"])
    if args.get("exit_code"):
        sys.exit(int(args["exit_code"]))
    if args.get("abort"):  # a native crash: SIGABRT, as glibc raises on a corrupted heap
        os.abort()
    time.sleep(float(args.get("sleep_s", 0)))
    if args.get("raise"):
        raise RuntimeError(str(args["raise"]))
    if rank in args.get("refuse_ranks", ()):  # a recovery that cannot happen, said as start_session's ranks say it
        from ..recovery.refusal import RecoveryImpossible, install

        install()
        raise RecoveryImpossible(str(args.get("refuse_why", "no copy, no checkpoint, no excision")))
    if args.get("raise_in_replacement") and incarnation > 0:
        raise RuntimeError(str(args["raise_in_replacement"]))
    import random

    import torch

    inductor = None
    if args.get("report_inductor"):  # a setting inductor read from the environment at its import
        import torch._inductor.config

        inductor = getattr(torch._inductor.config, str(args["report_inductor"]))
    return {
        "rank": rank,
        "world_size": world,
        "local_rank": int(os.environ["LOCAL_RANK"]),
        "pid": os.getpid(),
        "ppid": os.getppid(),
        "sid": os.getsid(0),
        "args": args,
        "incarnation": incarnation,
        "draw": random.random(),
        "env": {k: os.environ.get(k) for k in args.get("report_env", ())},
        "threads": torch.get_num_threads(),
        "inductor": inductor,
        "netns": os.readlink("/proc/self/ns/net"),
    }


if __name__ == "__main__":  # pragma: no cover
    from meshpact.exiting import run_then_exit

    run_then_exit(_main)
