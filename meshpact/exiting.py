"""How a process of Meshpact's own ends: as any process ends, without tearing down its heap.

At exit the interpreter joins the threads that are not daemons (after threading's own exit
hooks), runs the exit handlers (logging's shutdown, ``weakref.finalize`` callbacks,
multiprocessing's joins, whatever a library registered) and flushes standard output and error;
then it collects and frees its objects one by one. After ``import torch`` the last part alone
walks some 240,000 objects in several full collections, and a rank that built process groups
also destroys them. Measured on the 2-core machine: 0.5 s of CPU for a process that imported
torch and ran one gloo all-reduce; 1.3 s for each rank of a launcher drill that ran a recovery,
whose job ended 1.8 s later for it. All to give back memory the kernel takes back anyway.

:func:`end` does the first three and skips the last. :func:`run_then_exit` runs a main and ends
so; it is the ``__main__`` of the processes that run only Meshpact's code and close what they
write before they return: the ``meshpact`` command (and so ``meshpact launch``'s agents), the
fork servers, the launcher's workers, the excising reference's ranks and the Live page's runner.
A process whose main raises ends the usual way, the traceback printed.

A user's script started fresh ends the usual way too: its objects' finalizers may hold its last
writes. One forked warm by a fork server (``meshpact launch --warm-start``, the trials' ranks)
never had the teardown (a forked child ends with ``os._exit``); it ends through :func:`end`, so
its threads are joined and its exit handlers run as a fresh one's are.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import Callable, NoReturn


def exit_code(code: object) -> int:
    """The status a ``sys.exit(code)`` gives: 0 for None, an int as it is, anything else said on
    stderr and 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    sys.stderr.write(f"{code}\n")
    return 1


def end(status: int) -> NoReturn:
    """End the process with ``status`` as an exit ends it, less the heap's teardown."""
    # the interpreter's own first step: threading's exit hooks (concurrent.futures tells its idle
    # workers to stop there, so joining them without it would wait for ever), then every thread
    # that is not a daemon is joined
    threading._shutdown()  # type: ignore[attr-defined]  # private, but what Py_FinalizeEx calls first
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):  # closed, or its reader gone: as the interpreter ignores it
            pass
    os._exit(status)


def run_then_exit(main: Callable[[], int | None]) -> NoReturn:
    """Run ``main`` and end the process with its return value (or a ``SystemExit``'s code)."""
    try:
        code: object = main()
    except SystemExit as stop:
        code = stop.code
    end(exit_code(code))
