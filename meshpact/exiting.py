"""How a process of Meshpact's own ends: as any process ends, without tearing down its heap.

At exit the interpreter joins the threads that are not daemons, runs the exit handlers (logging's
shutdown, ``weakref.finalize`` callbacks, multiprocessing's joins, whatever a library registered)
and flushes standard output and error; then it collects and frees its objects one by one. After
``import torch`` the last part alone walks some 240,000 objects in several full collections, and a
rank that built process groups also destroys them. Measured on the 2-core machine: 0.5 s of CPU
for a process that imported torch and ran one gloo all-reduce; 1.3 s for each rank of a launcher
drill that ran a recovery, whose job ended 1.8 s later for it. All to give back memory the
kernel takes back anyway.

:func:`run_then_exit` does the first three and skips the last, for the processes that run only
Meshpact's code and close what they write before they return: the ``meshpact`` command (and so
``meshpact launch``'s agents), the fork servers, the launcher's workers, the excising reference's
ranks and the Live page's runner. A user's script is never ended this way: its objects'
finalizers may hold its last writes. A process whose main raises ends the usual way, the
traceback printed.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import Callable, NoReturn


def run_then_exit(main: Callable[[], int | None]) -> NoReturn:
    """Run ``main`` and end the process with its return value (or a ``SystemExit``'s code)."""
    code: int | str | None
    try:
        code = main()
    except SystemExit as stop:
        code = stop.code  # an int, None or a message, as sys.exit takes
    if isinstance(code, str):
        sys.stderr.write(code + "\n")
        code = 1
    for thread in threading.enumerate():  # what the interpreter's exit waits for
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):  # closed, or its reader gone: as the interpreter ignores it
            pass
    os._exit(int(code or 0))
