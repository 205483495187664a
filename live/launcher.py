"""Launcher: start N local ranks as real processes with a torchrun-compatible environment.

Each rank is a fresh Python process running ``python -m meshpact.live.launcher --target
module:function``. The environment is the one ``torchrun`` gives (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), so the same entry
point runs unchanged under ``torchrun --nproc-per-node N -m meshpact.live.launcher --target
...`` on one host or many. As torchrun's agent does, the launcher hosts the rendezvous
``TCPStore`` itself (workers connect as clients), so a rank that dies takes no store with it,
and it can start a replacement for one rank while the others keep running.

A worker function takes one ``dict`` of JSON arguments and returns a JSON-serialisable value;
the launcher collects each rank's value. Everything stops by itself: a deadline kills every
child still running, and so does leaving the ``with`` block or the interpreter.

Warm starts (``forkserver=``, a :class:`~meshpact.live.forkserver.ForkServer`, or a function
giving each rank's): the first process of each rank (and each spare) is forked from a process
that imported torch once instead of starting a fresh interpreter (a rank with a command
``prefix`` only by a server started under the same prefix, e.g. in its network namespace);
replacements start fresh, so their start is measured as a real one (``warm_replacements=True``
forks them too, for callers that measure no start: the test suite's trials).

Warm spares (``spares=N``): N more processes of the same target start with the ranks and wait
idle, warmed up (imports done), in :func:`await_promotion`; when a rank dies,
:meth:`Launch.promote` hands its rank to a waiting spare (a file in the launch's directory,
so no network is involved) instead of starting a cold replacement.

Replacements are bounded by ``max_replacements`` (None: no bound), as a scheduler's
capacity is: :meth:`Launch.replace` answers False once the launch has started that many, and
the caller tells the job that no replacement comes instead of leaving it waiting.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

from .store import host_store
from .worker import (ARGS_ENV, RESULT_DIR_ENV, SPARE_ENV, LaunchedProcess, LaunchError, RankResult, _main, _resolve,
                     await_promotion, write_result)

if TYPE_CHECKING:
    from .forkserver import ForkedProcess, ForkServer

__all__ = [
    "LaunchError",
    "LaunchedProcess",
    "RankResult",
    "Launch",
    "launch",
    "free_port",
    "host_store",
    "worker_env",
    "write_result",
    "await_promotion",
]



def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port the kernel reports free on ``host`` (bind to port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def worker_env(rank: int, world_size: int, master_addr: str, master_port: int,
               local_rank: int | None = None, local_world_size: int | None = None) -> dict[str, str]:
    """The torchrun environment for one rank."""
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(rank if local_rank is None else local_rank),
        "LOCAL_WORLD_SIZE": str(world_size if local_world_size is None else local_world_size),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
        "TORCHELASTIC_USE_AGENT_STORE": "True",  # the store is hosted outside the ranks, as under torchrun
    }


class Launch:
    """N rank processes of one worker target; use as a context manager.

    ``prefix(rank)`` may return a command prefix for a rank (e.g. ``["ip", "netns", "exec",
    "ns0"]``); ``env(rank)`` extra environment for it. ``store_host`` and ``store_port``
    name the rendezvous store; when ``host_stores`` is true (the default) the launcher
    hosts it in this process.
    """

    def __init__(
        self,
        target: str,
        world_size: int,
        args: Mapping[str, Any] | None = None,
        *,
        timeout_s: float = 120.0,
        master_addr: str = "127.0.0.1",
        master_port: int | None = None,
        host_stores: bool = True,
        env: Callable[[int], Mapping[str, str]] | None = None,
        prefix: Callable[[int], Sequence[str]] | None = None,
        python: str = sys.executable,
        spares: int = 0,
        forkserver: "ForkServer | Callable[[int], ForkServer | None] | None" = None,
        max_replacements: int | None = None,
        warm_replacements: bool = False,
        registry: str | os.PathLike[str] | None = None,
    ) -> None:
        if world_size < 1:
            raise LaunchError(f"world_size must be >= 1, got {world_size}")
        if spares < 0 or (spares and prefix is not None):
            raise LaunchError(f"spares must be 0 or more and run on the launcher's own host (no prefix), got "
                              f"{spares}{' with a prefix' if prefix is not None else ''}")
        if max_replacements is not None and max_replacements < 0:
            raise LaunchError(f"max_replacements must be 0 or more (or None: no bound), got {max_replacements}")
        _resolve(target)  # a bad target is reported here, not N times in the children
        self.target = target
        self.world_size = world_size
        self.args = dict(args or {})
        self.timeout_s = float(timeout_s)
        self.master_addr = master_addr
        self._store = host_store(master_addr, master_port or 0, world_size) if host_stores else None
        self.master_port = int(self._store.port) if self._store is not None else int(master_port or free_port(master_addr))
        self._extra_env = env
        self._prefix = prefix
        self._python = python
        self._forkserver = forkserver
        self._warm_replacements = warm_replacements  # replacements forked too: only where no start is measured
        self._registry = Path(registry) if registry is not None else None
        self._dir = Path(tempfile.mkdtemp(prefix="meshpact-launch-"))
        self._procs: dict[int, "subprocess.Popen | ForkedProcess"] = {}
        self._incarnation: dict[int, int] = {}
        self._stderr: dict[int, Any] = {}
        self.spares = spares
        self.max_replacements = max_replacements
        self.replacements_started = 0
        self._spares: dict[int, tuple["subprocess.Popen | ForkedProcess", Any]] = {}  # index -> waiting spare, its stderr
        self._deadline = time.monotonic() + self.timeout_s
        atexit.register(self.kill_all)

    # -- processes ---------------------------------------------------------------------
    def start(self) -> "Launch":
        (self._dir / "args.json").write_text(json.dumps(self.args))
        for rank in range(self.world_size):
            self._spawn(rank, incarnation=0)
        for i in range(self.spares):
            self._spawn(0, incarnation=0, spare=i)
        return self

    def _spawn(self, rank: int, incarnation: int, spare: int | None = None) -> None:
        env = dict(os.environ)
        env.update(worker_env(rank, self.world_size, self.master_addr, self.master_port))
        env[RESULT_DIR_ENV] = str(self._dir)
        env[ARGS_ENV] = str(self._dir / "args.json")
        env["MESHPACT_INCARNATION"] = str(incarnation)
        env.setdefault("OMP_NUM_THREADS", "1")
        if self._extra_env is not None:
            env.update({k: str(v) for k, v in self._extra_env(rank).items()})
        if spare is not None:
            env[SPARE_ENV] = str(spare)
        cmd = [*(self._prefix(rank) if self._prefix else ()), self._python, "-m", "meshpact.live.launcher",
               "--target", self.target]
        name = f"spare{spare}" if spare is not None else f"{rank}-{incarnation}"
        err = open(self._dir / f"stderr-{name}.txt", "w+b")
        proc: "subprocess.Popen | ForkedProcess"
        # a first process may start warm (forked), a replacement only with warm_replacements (else a
        # real new process); and only from a server started under the rank's own command prefix
        server = self._forkserver(rank) if callable(self._forkserver) else self._forkserver
        prefix = tuple(self._prefix(rank)) if self._prefix else ()
        eligible = (server is not None and (incarnation == 0 or self._warm_replacements) and server.prefix == prefix
                    and self._python == sys.executable)
        differs = server.differs(env) if eligible and server is not None else []
        if eligible and server is not None and not differs:
            proc = server.spawn(["--target", self.target], env, str(self._dir / f"stderr-{name}.txt"))
        else:
            if differs:  # said where a reader of the rank's stderr finds it: a cold start costs seconds
                err.write(f"meshpact launcher: started as a fresh interpreter, not forked: {', '.join(differs)} "
                          "differ(s) from the fork server's, which read them at import\n".encode())
                err.flush()
            proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
        if self._registry is not None:  # who each process is, for whoever looks from outside
            with open(self._registry, "a") as fh:
                fh.write(json.dumps(LaunchedProcess(proc.pid, None if spare is not None else rank, incarnation,
                                                    env.get("MESHPACT_RUN_ID", ""), spare).to_dict()) + "\n")
        if spare is not None:
            self._spares[spare] = (proc, err)
            return
        self._stderr[rank] = err
        self._procs[rank] = proc
        self._incarnation[rank] = incarnation

    def promote(self, rank: int) -> bool:
        """Hand ``rank`` (whose process has exited) to a waiting warm spare; False if none is left."""
        old = self._procs[rank]
        if old.poll() is None:
            raise LaunchError(f"rank {rank} (pid {old.pid}) is still running; kill it before replacing it")
        for i, (proc, err) in sorted(self._spares.items()):
            if proc.poll() is not None:
                continue
            del self._spares[i]
            incarnation = self._incarnation[rank] + 1
            path = self._dir / f"spare-{i}.json"
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps({"rank": rank, "incarnation": incarnation}))
            os.replace(tmp, path)
            self._procs[rank], self._stderr[rank], self._incarnation[rank] = proc, err, incarnation
            return True
        return False

    def pid(self, rank: int) -> int:
        return self._procs[rank].pid

    def poll(self) -> dict[int, int | None]:
        """Each rank's return code (None while it runs)."""
        return {r: p.poll() for r, p in self._procs.items()}

    def incarnation(self, rank: int) -> int:
        """0 for the first process of ``rank``, 1.. for its replacements."""
        return self._incarnation[rank]

    def replace(self, rank: int, extra_env: Mapping[str, str] | None = None) -> bool:
        """Start a replacement process for ``rank`` (the old one must have exited); False, and
        nothing started, once ``max_replacements`` have been started."""
        old = self._procs[rank]
        if old.poll() is None:
            raise LaunchError(f"rank {rank} (pid {old.pid}) is still running; kill it before replacing it")
        if self.max_replacements is not None and self.replacements_started >= self.max_replacements:
            return False
        self.replacements_started += 1
        if extra_env:
            prev = self._extra_env
            self._extra_env = lambda r, prev=prev, rank=rank, e=dict(extra_env): {
                **(prev(r) if prev else {}), **(e if r == rank else {})}
        self._spawn(rank, self._incarnation[rank] + 1)
        return True

    def kill(self, rank: int, sig: int = signal.SIGKILL) -> None:
        p = self._procs[rank]
        if p.poll() is None:
            p.send_signal(sig)

    def kill_all(self) -> None:
        for p in [*self._procs.values(), *(sp for sp, _ in self._spares.values())]:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    p.kill()
        for p in [*self._procs.values(), *(sp for sp, _ in self._spares.values())]:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass

    def wait(self, on_exit: Callable[["Launch", int, int], None] | None = None,
             poll_s: float = 0.02, on_tick: Callable[["Launch"], None] | None = None) -> list[RankResult]:
        """Wait for every rank; ``on_exit(launch, rank, returncode)`` sees each non-zero exit
        as it happens (it may call :meth:`replace`); ``on_tick(launch)`` runs every poll (it
        may call :meth:`kill`, e.g. for a rank the job declared lost). Kills everything at the
        deadline."""
        seen: dict[tuple[int, int], bool] = {}
        timed_out = False
        while True:
            running = False
            for rank, p in list(self._procs.items()):
                rc = p.poll()
                if rc is None:
                    running = True
                    continue
                key = (rank, self._incarnation[rank])
                if rc != 0 and not seen.get(key) and on_exit is not None:
                    seen[key] = True
                    on_exit(self, rank, rc)
                    if self._procs[rank].poll() is None:
                        running = True
            if not running:
                break
            if on_tick is not None:
                on_tick(self)
            if time.monotonic() > self._deadline:
                timed_out = True
                self.kill_all()
                break
            time.sleep(poll_s)
        results = [self._result(rank, killed=timed_out) for rank in sorted(self._procs)]
        return results

    def stderr_tail(self, rank: int, limit: int = 4000) -> str:
        """The last ``limit`` bytes of the stderr of ``rank``'s current process."""
        err = self._stderr[rank]
        err.flush()
        err.seek(0, os.SEEK_END)
        size = err.tell()
        err.seek(max(0, size - limit))
        return err.read().decode("utf-8", "replace")

    def _result(self, rank: int, killed: bool) -> RankResult:
        p = self._procs[rank]
        inc = self._incarnation[rank]
        path = self._dir / f"result-{rank}.json"
        value = json.loads(path.read_text()) if path.exists() else None
        tail = self.stderr_tail(rank)
        rc = p.poll()
        return RankResult(rank, None if (killed and rc in (None, -9)) else rc, value, tail, inc)

    def close(self) -> None:
        """Kill what still runs and remove the launch's scratch directory (results and
        stderr are read before; set ``MESHPACT_KEEP_LAUNCH_DIR=1`` to keep it for debugging)."""
        self.kill_all()
        for err in [*self._stderr.values(), *(e for _, e in self._spares.values())]:
            err.close()
        self._store = None
        atexit.unregister(self.kill_all)
        if not os.environ.get("MESHPACT_KEEP_LAUNCH_DIR"):
            shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> "Launch":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


_AGENT_KW = {"env", "forkserver"}  # what an AgentJob takes of Launch's arguments


def launch(target: str, world_size: int, args: Mapping[str, Any] | None = None, *, timeout_s: float = 120.0,
           check: bool = True, **kw: Any) -> list[RankResult]:
    """Run ``target`` on ``world_size`` ranks and return every rank's result.

    The ranks run under ``meshpact launch``'s agent (:class:`~meshpact.live.agentjob.AgentJob`,
    on loopback, in this process; no rank is replaced), unless ``kw`` asks for what only
    :class:`Launch` does (a command prefix, stores hosted elsewhere, another address).
    With ``check`` a failed or timed-out rank raises :class:`LaunchError` with its stderr.
    """
    agent = set(kw) <= _AGENT_KW | {"master_addr"} and kw.get("master_addr", "127.0.0.1") == "127.0.0.1"
    if agent:
        from .agentjob import AgentJob

        server = kw.get("forkserver")
        with AgentJob(target, world_size, args, timeout_s=timeout_s, env=kw.get("env"),
                      forkserver=server(0) if callable(server) else server) as agent_job:
            results = agent_job.run().results
    else:
        with Launch(target, world_size, args, timeout_s=timeout_s, **kw) as job:
            results = job.wait()
    if check:
        bad = [r for r in results if not r.ok]
        if bad:
            first = bad[0]
            what = "timed out" if first.returncode is None else f"exited with {first.returncode}"
            raise LaunchError(f"rank {first.rank} of {target} {what} (limit {timeout_s:.0f} s); "
                              f"its stderr ends:\n{first.stderr_tail}")
    return results


def echo(args: dict) -> dict:
    """A diagnostic worker: joins the rendezvous store and reports its environment. A first
    process of a rank in ``fail_ranks`` exits with 3 at once, and a replacement process raises
    ``raise_in_replacement`` when given (for replacement tests)."""
    import torch.distributed as dist

    await_promotion()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    incarnation = int(os.environ.get("MESHPACT_INCARNATION", "0"))
    if rank in args.get("fail_ranks", ()) and incarnation == 0:
        sys.exit(3)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                          timeout=timedelta(seconds=float(args.get("timeout_s", 30))))
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
    if args.get("raise_in_replacement") and incarnation > 0:
        raise RuntimeError(str(args["raise_in_replacement"]))
    import random

    import torch

    inductor = None
    if args.get("report_inductor"):  # a setting inductor read from the environment at its import
        import torch._inductor.config

        inductor = getattr(torch._inductor.config, str(args["report_inductor"]))
    return {"rank": rank, "world_size": world, "local_rank": int(os.environ["LOCAL_RANK"]),
            "pid": os.getpid(), "ppid": os.getppid(), "sid": os.getsid(0), "args": args, "incarnation": incarnation,
            "draw": random.random(), "env": {k: os.environ.get(k) for k in args.get("report_env", ())},
            "threads": torch.get_num_threads(), "inductor": inductor}


if __name__ == "__main__":  # pragma: no cover
    sys.exit(_main())
