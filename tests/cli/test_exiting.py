"""A process ended by :func:`~meshpact.exiting.run_then_exit` keeps every effect of a normal exit
but the heap's teardown: its code, its exit handlers, its threads' work and its buffered output."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

PROGRAM = textwrap.dedent(
    """
    import atexit, concurrent.futures, sys, threading, time
    from meshpact.exiting import run_then_exit

    out = sys.argv[1]
    kind = sys.argv[2]

    def main():
        atexit.register(lambda: open(out, "a").write("atexit\\n"))
        def late():
            time.sleep(0.3)
            open(out, "a").write("thread\\n")
        threading.Thread(target=late).start()  # not a daemon: the exit waits for it
        # an idle pool never shut down: its workers stop only when threading's exit hook tells them
        concurrent.futures.ThreadPoolExecutor(2).submit(int, 1).result()
        sys.stdout.write("buffered, never flushed by main")
        if kind == "exit":
            sys.exit(3)
        if kind == "message":
            sys.exit("a message")
        if kind == "object":
            sys.exit(["not", "a", "code"])
        if kind == "raise":
            raise RuntimeError("boom")
        return 5

    run_then_exit(main)
    """
)


@pytest.mark.parametrize(
    "kind, code, err",
    [
        ("return", 5, ""),
        ("exit", 3, ""),
        ("message", 1, "a message\n"),
        ("object", 1, "['not', 'a', 'code']\n"),
        ("raise", 1, None),
    ],
)
def test_the_code_the_handlers_the_threads_and_the_output_survive(tmp_path, kind, code, err):
    out = tmp_path / "effects"
    done = subprocess.run([sys.executable, "-c", PROGRAM, str(out), kind], capture_output=True, text=True, timeout=60)
    assert done.returncode == code, done.stderr
    assert done.stdout == "buffered, never flushed by main"
    if err is None:  # the usual exit: the traceback printed
        assert "RuntimeError: boom" in done.stderr
    else:
        assert done.stderr == err
    assert out.read_text().split() == ["thread", "atexit"]  # the thread joined first, then the handlers ran
