"""A warm spare for any torchrun worker command: an interpreter with torch imported, waiting for a rank.

``python -u -m meshpact.live.launch.warmspare ASSIGNMENT`` imports what every rank of a training job
imports first (:data:`PRELOAD`: torch, torch.distributed, FSDP,
DTensor, dynamo; and Meshpact's recovery runtime, :data:`RUNTIME`) and then waits for the file ``ASSIGNMENT`` to appear. The launcher writes it
(atomically) when a worker of its node has died: the lost rank's whole worker environment
(``RANK``, ``LOCAL_RANK``, ``MESHPACT_INCARNATION``, ``TORCHELASTIC_ERROR_FILE``, ...), the
worker's command line (``-u script.py args`` or ``-u -m module args``, as torchrun builds it)
and where its output goes. The spare takes that environment, points its stdout and stderr
there and runs the command in this interpreter as ``python`` would have, ``__main__`` and
``sys.argv`` included. Its start is then the job's own imports and set-up, not an
interpreter's and torch's.

On a GPU the spare also makes its device's context (``LOCAL_RANK``'s device is known only at
promotion, so it is made for the device the spare was started beside,
``MESHPACT_SPARE_DEVICE``, when set). Once loaded it creates ``ASSIGNMENT`` with the suffix
``.ready`` (:func:`ready_path`), which the launcher reports. A spare whose launcher is gone exits.
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import runpy
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

__all__ = ["Assignment", "assign", "ready_path", "main", "run_python", "runnable", "PRELOAD", "RUNTIME"]

# what every rank imports first, whatever its job; torch._dynamo too: FSDP2's first shard imports it in
# every rank (0.8 s of CPU each on the two-core machine), and it brings torch._inductor's configuration
PRELOAD = ("torch", "torch.distributed", "torch.distributed.fsdp", "torch.distributed.tensor", "torch._dynamo")
# what a Meshpact job imports on top of torch: a promoted spare starts its script with them loaded
RUNTIME = (
    "numpy",
    "meshpact.live.recovery.session",
    "meshpact.live.recovery.runtime",
    "meshpact.live.recovery.state",
    "meshpact.live.recovery.peers",
)


@dataclass(frozen=True)
class Assignment:
    """What a promoted spare becomes: a worker's environment, command and output files."""

    env: dict[str, str]
    argv: tuple[str, ...]  # the interpreter's arguments after ``python``: ("-u", "train.py", "--lr", "1")
    stdout: str  # a file to append to, or "" (keep the spare's)
    stderr: str

    def to_dict(self) -> dict[str, object]:
        return {"env": self.env, "argv": list(self.argv), "stdout": self.stdout, "stderr": self.stderr}

    @classmethod
    def from_dict(cls, d: dict[str, object]) -> "Assignment":
        env = d["env"]
        argv = d["argv"]
        assert isinstance(env, dict) and isinstance(argv, list)
        return cls(
            {str(k): str(v) for k, v in env.items()},
            tuple(str(a) for a in argv),
            str(d.get("stdout") or ""),
            str(d.get("stderr") or ""),
        )


def assign(path: str | os.PathLike[str], assignment: Assignment) -> None:
    """Hand ``assignment`` to the spare waiting on ``path`` (an atomic rename: it never reads half),
    readable by this user alone: the environment carries the job key."""
    target = Path(path)
    tmp = target.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(json.dumps(assignment.to_dict()))
    os.replace(tmp, target)


def ready_path(assignment: str | os.PathLike[str]) -> Path:
    """The file a spare waiting on ``assignment`` creates once its imports are done."""
    return Path(assignment).with_suffix(".ready")


def _redirect(path: str, fd: int) -> None:
    if not path:
        return
    target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(target, fd)
    os.close(target)


def runnable(argv: Sequence[str]) -> bool:
    """Whether :func:`run_python` runs ``python *argv`` as ``python`` would: the forms torchrun gives,
    ``[-u] script args`` or ``[-u] -m module args``, and no other interpreter option."""
    args = list(argv)
    while args and args[0] == "-u":
        args.pop(0)
    if not args:
        return False
    if args[0] == "-m":
        return len(args) >= 2 and bool(args[1]) and not args[1].startswith("-")
    return not args[0].startswith("-")


def run_python(argv: Sequence[str]) -> None:
    """Run ``python *argv`` in this interpreter (the forms torchrun gives: [-u] [-m module | script] args)."""
    args = [a for a in argv]
    while args and args[0] in ("-u",):
        args.pop(0)
    if not args:
        raise SystemExit("meshpact warm spare: the assignment names no script or module")
    if args[0] == "-m":
        module, rest = args[1], args[2:]
        sys.argv = [module, *rest]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        script, rest = args[0], args[1:]
        sys.argv = [script, *rest]
        sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
        runpy.run_path(script, run_name="__main__")


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        sys.stderr.write("usage: python -m meshpact.live.launch.warmspare ASSIGNMENT_FILE\n")
        return 2
    path = Path(args[0])
    for name in PRELOAD:
        importlib.import_module(name)
    for name in RUNTIME:
        try:
            importlib.import_module(name)
        except ImportError:  # not installed here: the script imports what it needs when it runs
            pass
    device = os.environ.get("MESHPACT_SPARE_DEVICE")
    if device is not None:
        import torch

        if torch.cuda.is_available():
            torch.cuda.set_device(int(device))
            torch.cuda.init()
    # what is loaded now (torch and the runtime: most of the heap) is left out of the garbage
    # collector's scans, as the runtime does once training starts: the job's first walk of the
    # heap for its meshes and schedulers (all made by the script, after this) then skips it
    gc.freeze()
    ready_path(path).touch()
    parent = os.getppid()
    while not path.exists():
        if os.getppid() != parent:  # the launcher is gone: nobody will promote this spare
            return 0
        time.sleep(0.005)
    assignment = Assignment.from_dict(json.loads(path.read_text()))
    os.environ.update(assignment.env)
    sys.stdout.flush()
    sys.stderr.flush()
    _redirect(assignment.stdout, 1)
    _redirect(assignment.stderr, 2)
    run_python(assignment.argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
