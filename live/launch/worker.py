"""The worker side of a launch: what runs inside each rank process.

``python -m meshpact.live.launch.launcher --target module:function`` (a fresh interpreter) and a
:class:`~meshpact.live.launch.forkserver.ForkServer`'s forked child both enter a rank through
:func:`_main`; the launcher and the fork server import it from here, so neither imports the other.
"""

from __future__ import annotations

import argparse
import faulthandler
import importlib
import json
import os
import signal
import sys
from pathlib import Path
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from meshpact.core.errors import MeshpactError

from ..store import host_store

__all__ = ["LaunchError", "LaunchedProcess", "RankResult", "write_result", "worker_args"]

RESULT_DIR_ENV = "MESHPACT_RESULT_DIR"
ARGS_ENV = "MESHPACT_WORKER_ARGS"


class LaunchError(MeshpactError):
    """A worker failed, timed out, or was given a target that cannot be run."""


@dataclass(frozen=True)
class LaunchedProcess:
    """One process a launch started, as its ``registry`` file lists it (a JSON line each): a
    forked rank's ``/proc/<pid>/environ`` is its fork server's, so whoever looks for the ranks
    from outside (the dashboard) learns here which rank a process is."""

    pid: int
    rank: int | None  # None: a spare not yet promoted
    incarnation: int
    run_id: str  # MESHPACT_RUN_ID (a trial's phase)
    spare: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "pid": self.pid,
            "rank": self.rank,
            "incarnation": self.incarnation,
            "run_id": self.run_id,
            "spare": self.spare,
        }

    @classmethod
    def read(cls, path: str | os.PathLike[str]) -> list["LaunchedProcess"]:
        """Every complete line of ``path`` (none when it does not exist yet; a torn line is skipped)."""
        try:
            lines = Path(path).read_text().splitlines()
        except OSError:
            return []
        out = []
        for line in lines:
            try:
                d = json.loads(line)
                out.append(
                    cls(
                        int(d["pid"]),
                        None if d.get("rank") is None else int(d["rank"]),
                        int(d.get("incarnation", 0)),
                        str(d.get("run_id", "")),
                        None if d.get("spare") is None else int(d["spare"]),
                    )
                )
            except (ValueError, TypeError, KeyError):
                continue
        return out


@dataclass(frozen=True)
class RankResult:
    rank: int
    returncode: int | None  # None: killed at the deadline
    value: Any  # what the worker function returned (None if it did not finish)
    stderr_tail: str = ""
    incarnation: int = 0  # 0 for the first process of this rank, 1.. for replacements

    @property
    def ok(self) -> bool:
        return self.returncode == 0


def _resolve(target: str) -> Callable[[dict], Any]:
    module, sep, name = target.partition(":")
    if not sep or not module or not name:
        raise LaunchError(f"worker target {target!r} is not 'package.module:function'")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise LaunchError(f"worker target {target!r} cannot be loaded: {exc}") from None
    if not callable(fn):
        raise LaunchError(f"worker target {target!r} is not callable")
    return fn


def write_result(value: Any) -> None:
    """Write this rank's result where the launcher collects it (atomic rename)."""
    out = os.environ.get(RESULT_DIR_ENV)
    if not out:
        return
    rank = os.environ.get("RANK", "0")
    path = Path(out) / f"result-{rank}.json"
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(value))
    os.replace(tmp, path)


def worker_args() -> dict:
    """The JSON arguments the launcher handed this worker (``{}`` under plain torchrun)."""
    path = os.environ.get(ARGS_ENV)
    return json.loads(Path(path).read_text()) if path and Path(path).exists() else {}


def _serve_stores(addresses: Sequence[str]) -> int:
    stores = []
    for address in addresses:
        host, _, port = address.rpartition(":")
        stores.append(host_store(host, int(port or 0)))
    sys.stdout.write("PORTS " + " ".join(str(s.port) for s in stores) + "\n")
    sys.stdout.flush()
    sys.stdin.read()  # until the parent closes our stdin or dies
    return 0


def _main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m meshpact.live.launch.launcher",
        description="Run one rank of a Meshpact worker (torchrun-compatible).",
    )
    parser.add_argument("--target", help="package.module:function taking a dict of arguments")
    parser.add_argument("--args", default=None, help="JSON arguments (overrides the launcher's)")
    parser.add_argument(
        "--serve-stores",
        nargs="+",
        metavar="HOST:PORT",
        help="host TCPStores (port 0: the kernel picks), print 'PORTS p1 p2 ...', serve until stdin closes",
    )
    ns = parser.parse_args(argv)
    if ns.serve_stores:
        return _serve_stores(ns.serve_stores)
    if not ns.target:
        parser.error("--target is required")
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        sys.stderr.write(f"error: missing torchrun environment {missing}; run under torchrun or the launcher\n")
        return 2
    # a rank that dies of a fatal signal (a native crash, an abort on a corrupted heap) leaves
    # every thread's Python stack in its stderr, which the launcher's error names
    faulthandler.enable(all_threads=True)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # a hung rank's stacks on demand: kill -USR1 <pid>
    fn = _resolve(ns.target)
    args = json.loads(ns.args) if ns.args else worker_args()
    value = fn(args)
    write_result(value)
    return 0
