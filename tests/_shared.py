"""Fault-free runs computed once per test session and read by every test file that needs them.

A reference run is deterministic: the same workload, ranks, steps and script end with the same
bits whoever runs them. ``make test``'s two workers each run whole files, so a reference two
files need was run twice, once in each worker. :func:`once` runs it in the first worker that asks,
under a lock the other waits on, into a folder of the session (``tests/conftest.py`` makes it
in the controller and hands it to the workers as :data:`SESSION_DIR_ENV`); a later caller finds
it finished and reads it. A run that failed leaves no mark, so the next caller runs it again
and meets the same failure itself.
"""

from __future__ import annotations

import atexit
import fcntl
import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

SESSION_DIR_ENV = "MESHPACT_TEST_SESSION_DIR"
_DONE = ".done"
_OWN: list[Path] = []


def session_dir() -> Path:
    """The session's folder for shared runs (one of this process's own outside a pytest session)."""
    shared = os.environ.get(SESSION_DIR_ENV)
    if shared:
        return Path(shared)
    if not _OWN:
        own = Path(tempfile.mkdtemp(prefix="meshpact-test-session-"))
        atexit.register(shutil.rmtree, own, True)
        _OWN.append(own)
    return _OWN[0]


def once(what: str, run: Callable[[Path], None]) -> Path:
    """The folder ``run`` filled for ``what`` (a description of the run: every setting it depends
    on), running it here unless this session already has."""
    key = hashlib.sha256(what.encode()).hexdigest()[:16]
    folder = session_dir() / key
    with open(session_dir() / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the other worker, running it now, finishes first
        if not (folder / _DONE).exists():
            shutil.rmtree(folder, ignore_errors=True)  # a failed run's leftovers
            folder.mkdir(parents=True)
            run(folder)
            (folder / _DONE).write_text(what)
    return folder
