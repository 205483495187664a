"""A recovery that cannot happen: the same one line on every rank, and no replacement for it.

When no policy can recover the job — a lost rank's state has no peer copy, there is no
checkpoint to restore, and the job offers no excision (or its replacement never comes) — every
rank raises :class:`RecoveryImpossible` with the same message: the group's decision and what is
missing. The ranks decide it together, so a new process for a rank that raised it would hold
nothing and decide the same.

How a rank's exit reaches the agent: :func:`install` (``start_session`` calls it) sets a hook
for an exception the rank's script leaves uncaught. For :class:`RecoveryImpossible` it writes
the one line on stderr instead of a traceback, and leaves a marker file where the agent named one
in the rank's environment (:data:`REFUSAL_FILE_ENV`, a file per process); the process exits
with status 1 as any uncaught exception's does. ``meshpact launch``'s agent reads the marker when
the process exits (:func:`read_refusal`) and starts no replacement for it: it announces the rank
gone, and the job ends once, each rank having said why. Other exceptions go to the hook that was
there before.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import TracebackType
from typing import Callable, Mapping

__all__ = [
    "RecoveryImpossible",
    "REFUSAL_FILE_ENV",
    "REFUSAL_LINE",
    "install",
    "read_refusal",
    "leave_marker",
    "one_line",
    "without_checkpoint",
]

REFUSAL_FILE_ENV = "MESHPACT_REFUSAL_FILE"  # the marker file of this process, named by the agent
REFUSAL_LINE = "meshpact: this job cannot recover: "  # how the one line opens on every rank
_MARKER_MOST = 4096  # bytes of a marker the agent reads (the message's first line)

_Hook = Callable[[type[BaseException], BaseException, "TracebackType | None"], object]


class RecoveryImpossible(RuntimeError):
    """No policy can recover the job (see the module docstring); the message says what is missing."""


def without_checkpoint(reason: str, has_directory: bool) -> RecoveryImpossible:
    """The refusal of a decision to restore a checkpoint where there is none: ``reason`` is the
    decision's (why memory cannot serve), ``has_directory`` whether a checkpoint folder is set."""
    why = "no complete checkpoint exists" if has_directory else "no checkpoint directory is set"
    return RecoveryImpossible(f"cannot recover in memory ({reason}) and {why}")


def one_line(exc: BaseException) -> str:
    """The line every rank says for ``exc``."""
    text = " ".join(str(exc).split())
    return f"{REFUSAL_LINE}{text}"


def leave_marker(line: str, environ: Mapping[str, str] = os.environ) -> Path | None:
    """Write ``line`` to this process's marker file (atomically), where the agent named one."""
    target = environ.get(REFUSAL_FILE_ENV)
    if not target:
        return None
    path = Path(target)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(line[:_MARKER_MOST] + "\n")
    os.replace(tmp, path)
    return path


def read_refusal(path: str | os.PathLike[str] | None) -> str | None:
    """The agent's side: the line a process left in its marker file ``path`` (None: none left)."""
    if not path:
        return None
    try:
        with open(path, "rb") as fh:
            raw = fh.read(_MARKER_MOST)
    except OSError:
        return None
    return raw.decode("utf-8", "replace").strip().splitlines()[0] if raw.strip() else None


def install() -> None:
    """Set the hook for an uncaught :class:`RecoveryImpossible` (once per process; see the module docstring)."""
    previous: _Hook = sys.excepthook
    if getattr(previous, "_meshpact_refusal", False):
        return

    def hook(kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> object:
        if not isinstance(exc, RecoveryImpossible):
            return previous(kind, exc, tb)
        line = one_line(exc)
        try:
            leave_marker(line)
        except OSError as err:  # the agent then replaces the rank as for any failure; said beside the line
            line += f" (the marker file for the launcher could not be written: {err})"
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
        return None

    hook._meshpact_refusal = True  # type: ignore[attr-defined]  # a mark on the function: the hook is ours
    sys.excepthook = hook
