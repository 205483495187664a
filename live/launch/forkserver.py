"""Fork server: rank processes started warm, forked from a process that imported torch once.

A rank started as a fresh interpreter spends about two seconds of CPU importing torch before
it runs a line of the job: four ranks on a two-core machine take about four seconds to start.
A :class:`ForkServer` is one helper process that imports the heavy, environment-independent
modules (``torch``, ``torch.distributed`` and its FSDP and DTensor packages, dynamo) once and then
forks each rank on request, so a rank's start is a ``fork`` plus the job's own imports. Each
child becomes what ``python -m meshpact.live.launch.launcher --target ...`` would have been: its
own session (``setsid``), the launcher's environment (replacing the server's wholesale), its
stderr in the launcher's file, stdin and stdout on ``/dev/null``, Python's and NumPy's global
generators seeded afresh from the OS as a new interpreter's are; then the launcher's
``_main`` runs and its return code is the child's exit status.

Forking is safe only from a single-threaded process: the server runs with
``OMP_NUM_THREADS=1`` (so neither OpenMP nor OpenBLAS starts a pool at import), checks that
it has one thread before it says ready, and serves only launches whose ranks ask for the
same (the launcher's default) and whose other variables read at import (torch's, dynamo's and
inductor's settings: :data:`IMPORT_TIME_ENV`) are the server's, the same set with the same
values. Anything else (another interpreter, other thread counts or torch settings, a
command prefix such as ``ip netns exec`` other than the one the server itself was started
under) starts fresh interpreters as before. A trial whose ranks run in two network
namespaces starts one server in each.

A warm rank differs from a fresh one in two ways. What the server preloaded was imported before
any process group existed, so a module that captures c10d's default group at import
(``torch.distributed.nn.functional``'s default arguments) holds none: the rebinding audits, which
look for exactly those references, fork from a server that imported torch alone. And the child
freezes the server's heap (``gc.freeze``) before it runs anything, so the collector's scans and
``gc.get_referrers`` read only what the rank made (no mesh, scheduler or group exists before),
and cyclic garbage of the server's imports is never collected.

Where a start must be measured as a real process start — a replacement for a killed rank, a
cold restart — the launcher starts a fresh interpreter even when a server is at hand, so
warm starts never flatter a recovery figure.

``meshpact launch --warm-start`` asks for two more kinds of child: a worker running any Python
command line torchrun would have started (``python -u script.py ARGS`` or ``-m module``), run as
a promoted warm spare runs it (:func:`~meshpact.live.launch.warmspare.run_python`: ``__main__``,
``sys.argv`` and ``sys.path[0]`` as ``python`` sets them, stdout and stderr in the worker's
files), and a warm spare waiting for a rank (:func:`~meshpact.live.launch.warmspare.main`, its
imports already done).

The protocol is JSON lines on the server's stdin (requests) and stdout (replies): a request
``{"id", "env", "cwd", "stderr"}`` with one of ``"argv"`` (the launcher's arguments),
``"python"`` (python's arguments; ``"stdout"`` too) or ``"spare"`` (the spare's assignment file)
is answered ``{"id", "pid"}``; each child's end is reported ``{"exit": pid, "rc": code}``
(``-N`` for signal ``N``, as ``subprocess`` reports it). The server exits when its stdin
closes; the children it started are the launcher's to stop.
"""

from __future__ import annotations

import importlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Mapping, Sequence

from meshpact.core.errors import MeshpactError
from meshpact.exiting import end, exit_code, run_then_exit

from .warmspare import PRELOAD, run_python
from .warmspare import main as wait_as_spare

__all__ = [
    "ForkServer",
    "ForkServerError",
    "ForkedProcess",
    "PRELOAD",
    "SINGLE_THREAD_ENV",
    "IMPORT_TIME_ENV",
    "import_time_env",
]

SINGLE_THREAD_ENV = {"OMP_NUM_THREADS": "1"}  # no thread pool at import: the server may fork
# torch, dynamo and inductor read their settings from these variables when they are imported,
# the thread pools theirs when they start: a child forked after the imports has the server's.
# Read when used, so not compared: TORCHELASTIC_* (when a group is made; the launcher sets one
# for every rank), TORCH_NCCL_* (when an NCCL group is made; elastic's agent sets
# TORCH_NCCL_ASYNC_ERROR_HANDLING for every worker) and TORCHINDUCTOR_CACHE_DIR (at each cache
# lookup; inductor also writes it into the environment at its first compile, so a launcher that
# compiled anything would otherwise start every later rank fresh).
IMPORT_TIME_ENV = ("TORCH", "PYTORCH", "OMP_", "MKL_", "KMP_", "OPENBLAS_")
READ_WHEN_USED_ENV = ("TORCHELASTIC_", "TORCH_NCCL_", "TORCHINDUCTOR_CACHE_DIR")


def import_time_env(env: Mapping[str, str]) -> dict[str, str]:
    """The part of ``env`` a preloaded module may have read at import (see IMPORT_TIME_ENV)."""
    return {k: v for k, v in env.items() if k.startswith(IMPORT_TIME_ENV) and not k.startswith(READ_WHEN_USED_ENV)}


_READY = b"READY\n"
# the descriptors (stdout,stderr) a server shares with its launcher (``share_output``), by number
_SHARED_OUTPUT_ENV = "MESHPACT_FORKSERVER_OUTPUT_FDS"


class ForkServerError(MeshpactError):
    """The fork server did not start or stopped answering."""


class ForkedProcess:
    """A rank forked by the server, with the part of :class:`subprocess.Popen`'s interface the
    launcher uses (``pid``, ``poll``, ``wait``, ``send_signal``, ``kill``)."""

    def __init__(self, server: "ForkServer", pid: int) -> None:
        self._server = server
        self.pid = pid

    def poll(self) -> int | None:
        return self._server.returncode(self.pid)

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (rc := self.poll()) is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"forked rank pid {self.pid}", timeout or 0.0)
            self._server.wait_for_exit(0.05)
        return rc

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """The launcher's side: start the server (``with ForkServer() as fs``), then
    :meth:`spawn` ranks. ``accepts(env)`` says whether a rank with that environment may be
    forked (what the preloaded modules read at import, thread settings included, matches)."""

    def __init__(
        self,
        preload: Sequence[str] = PRELOAD,
        start_timeout_s: float = 120.0,
        prefix: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        share_output: bool = False,
    ) -> None:
        """``prefix``: a command the server runs under (``ip netns exec NS``: its children are
        forked inside that network namespace, as ranks started with the same prefix would run);
        ``env``: the server's environment, thread settings included (a launcher whose workers run
        with more threads than one); by default this process's with :data:`SINGLE_THREAD_ENV`.
        Either way the server refuses to serve if its imports started a thread. ``share_output``: a
        child given no file for its stdout or stderr writes to this process's (as a subprocess
        started here would), not to the server's (a pipe and a private file)."""
        env = {**os.environ, **SINGLE_THREAD_ENV} if env is None else dict(env)
        self.prefix = tuple(prefix)
        self._import_env = import_time_env(env)
        self._stderr = tempfile.TemporaryFile()  # a file, not a pipe: a chatty import can never block the server
        shared: tuple[int, ...] = ()
        if share_output:
            shared = (os.dup(1), os.dup(2))
            env[_SHARED_OUTPUT_ENV] = f"{shared[0]},{shared[1]}"
        try:
            self._proc = subprocess.Popen(
                [*self.prefix, sys.executable, "-m", "meshpact.live.launch.forkserver", *preload],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=self._stderr,
                env=env,
                start_new_session=True,
                pass_fds=shared,
            )
        finally:
            for fd in shared:
                os.close(fd)
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._lock = threading.Lock()
        self._changed = threading.Condition()
        self._replies: dict[int, int] = {}  # request id -> pid
        self._exits: dict[int, int] = {}  # pid -> return code
        self._next_id = 0
        self._start_timeout_s = start_timeout_s
        self._started = time.monotonic()
        self._reader: threading.Thread | None = None  # started once the server said it is ready

    @property
    def pid(self) -> int:
        """The server's process: the parent of every rank it forks."""
        return int(self._proc.pid)

    def _ready(self) -> None:
        """Wait for the server's imports (they run while the launcher does its own set-up)."""
        if self._reader is not None:
            return
        assert self._proc.stdout is not None
        left = self._started + self._start_timeout_s - time.monotonic()
        ready = _read_line(self._proc.stdout, max(left, 0.0))
        if ready != _READY:
            self._proc.kill()
            self._proc.wait(timeout=5)
            self._stderr.seek(0)
            err = self._stderr.read().decode("utf-8", "replace")
            raise ForkServerError(
                f"the fork server did not start within {self._start_timeout_s:.0f} s "
                f"(it said {ready!r}); its stderr ends: {err[-2000:]}"
            )
        self._reader = threading.Thread(target=self._read, name="meshpact-forkserver-replies", daemon=True)
        self._reader.start()

    def ready(self, timeout_s: float = 0.0) -> bool:
        """Whether the server has finished its imports, waiting ``timeout_s`` at most for it (a
        caller with something else to do meanwhile, such as an agent's beats, asks again);
        :class:`ForkServerError` once it failed or its start timeout has passed."""
        with self._lock:
            if self._reader is not None:
                return True
            assert self._proc.stdout is not None
            left = self._started + self._start_timeout_s - time.monotonic()
            readable, _, _ = select.select([self._proc.stdout], [], [], max(min(timeout_s, left), 0.0))
            if not readable and left > timeout_s:
                return False
            self._ready()
            return True

    def differs(self, env: Mapping[str, str]) -> list[str]:
        """The variables read at import (IMPORT_TIME_ENV) that ``env`` sets otherwise than the
        server had them, set or unset, by name: a rank with any of them starts fresh."""
        mine = import_time_env(env)
        return sorted(k for k in mine.keys() | self._import_env.keys() if mine.get(k) != self._import_env.get(k))

    def accepts(self, env: Mapping[str, str]) -> bool:
        return not self.differs(env)

    def spawn(
        self,
        argv: Sequence[str],
        env: Mapping[str, str],
        stderr_path: str,
        timeout_s: float = 30.0,
        netns: str | None = None,
    ) -> ForkedProcess:
        """Fork one child running ``python -m meshpact.live.launch.launcher *argv`` with ``env``;
        ``netns``: in that network namespace (an ``ip netns`` name), where ``ip netns exec`` would
        run it (the network only: ``/sys`` is the server's), from a server that runs outside it."""
        what: dict[str, Any] = {"argv": list(argv), **({"netns": netns} if netns else {})}
        return self._request(what, env, stderr_path, timeout_s)

    def spawn_python(
        self,
        python_argv: Sequence[str],
        env: Mapping[str, str],
        stdout_path: str,
        stderr_path: str,
        timeout_s: float = 30.0,
    ) -> ForkedProcess:
        """Fork one child running ``python *python_argv`` (``-u script.py ARGS`` or ``-u -m module ARGS``,
        :func:`~meshpact.live.launch.warmspare.runnable`) with ``env`` (wholesale) and its output in
        the files given ("": the server's own)."""
        return self._request({"python": list(python_argv), "stdout": stdout_path}, env, stderr_path, timeout_s)

    def spawn_spare(self, assignment: str, env: Mapping[str, str], timeout_s: float = 30.0) -> ForkedProcess:
        """Fork one warm spare waiting on the file ``assignment``
        (:mod:`~meshpact.live.launch.warmspare`), with ``env`` until a rank's is assigned."""
        return self._request({"spare": assignment}, env, "", timeout_s)

    def _request(
        self, what: Mapping[str, Any], env: Mapping[str, str], stderr_path: str, timeout_s: float
    ) -> ForkedProcess:
        with self._lock:
            self._ready()
            rid = self._next_id
            self._next_id += 1
            line = json.dumps({"id": rid, **what, "env": dict(env), "cwd": os.getcwd(), "stderr": stderr_path}) + "\n"
            try:
                assert self._proc.stdin is not None
                self._proc.stdin.write(line.encode())
                self._proc.stdin.flush()
            except (BrokenPipeError, OSError) as exc:
                raise ForkServerError(f"the fork server is gone ({exc})") from None
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while rid not in self._replies:
                left = deadline - time.monotonic()
                if left <= 0 or self._proc.poll() is not None:
                    raise ForkServerError(f"the fork server did not fork a rank within {timeout_s:.0f} s")
                self._changed.wait(min(left, 0.1))
            return ForkedProcess(self, self._replies.pop(rid))

    def returncode(self, pid: int) -> int | None:
        with self._changed:
            return self._exits.get(pid)

    def wait_for_exit(self, timeout_s: float) -> None:
        with self._changed:
            self._changed.wait(timeout_s)

    def _read(self) -> None:
        assert self._proc.stdout is not None
        try:
            for raw in self._proc.stdout:
                self._take(raw)
        except (ValueError, OSError):  # the stream closed under us: the server is gone
            return

    def _take(self, raw: bytes) -> None:
        try:
            msg = json.loads(raw)
        except ValueError:
            return
        with self._changed:
            if "exit" in msg:
                self._exits[int(msg["exit"])] = int(msg["rc"])
            else:  # a new child: an exit kept for an earlier child with its pid (reused) is not its own
                self._exits.pop(int(msg["pid"]), None)
                self._replies[int(msg["id"])] = int(msg["pid"])
            self._changed.notify_all()

    def close(self) -> None:
        """Stop the server (its children are the launcher's to stop)."""
        if self._proc.poll() is None:
            try:
                assert self._proc.stdin is not None
                self._proc.stdin.close()
            except OSError:
                pass
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(timeout=5)
        if self._reader is not None:
            self._reader.join(timeout=5)  # it reads to the end of the server's output, then stops
        if self._proc.stdout is not None:
            self._proc.stdout.close()
        self._stderr.close()

    def __enter__(self) -> "ForkServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _read_line(stream: Any, timeout_s: float) -> bytes:
    ready, _, _ = select.select([stream], [], [], timeout_s)
    return stream.readline() if ready else b""


# -- the server side ------------------------------------------------------------------------
def _child(req: Mapping[str, Any]) -> int:
    """In the forked child: become the rank the request describes and run it."""
    if req.get("netns"):
        from ..netns import move_into

        move_into(str(req["netns"]))
    os.setsid()
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    shared = [int(fd) for fd in os.environ.get(_SHARED_OUTPUT_ENV, "").split(",") if fd]
    for path, target in ((str(req.get("stdout") or ""), 1), (str(req["stderr"]), 2)):
        if path:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.dup2(fd, target)
            os.close(fd)
        elif shared and "argv" not in req:  # the launcher's own output (the server's stdout is its replies)
            os.dup2(shared[target - 1], target)
        elif target == 1:  # never the replies' pipe
            os.dup2(null, target)
    for fd in (null, *shared):
        os.close(fd)
    os.chdir(str(req["cwd"]))
    os.environ.clear()
    os.environ.update({str(k): str(v) for k, v in req["env"].items()})
    import random

    random.seed()  # a new interpreter's generators are seeded from the OS, not shared with its siblings
    if "numpy.random" in sys.modules:
        sys.modules["numpy.random"].seed()
    if "spare" in req:
        return wait_as_spare([str(req["spare"])])
    import gc

    # what the server loaded stays out of the collector's scans, as in a promoted spare: a full collection
    # and a rank start's search for its meshes and schedulers (state.instances_of) read only what the
    # rank made, not the 300,000 objects of torch's imports (none of them a mesh, a scheduler or a group)
    gc.freeze()
    if "python" in req:
        run_python([str(a) for a in req["python"]])
        return 0
    from .worker import _main

    sys.argv = ["-m meshpact.live.launch.launcher", *req["argv"]]
    return _main(list(req["argv"]))


def _fork(req: Mapping[str, Any], wake: tuple[int, int]) -> int:
    pid = os.fork()
    if pid:
        return pid
    rc = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for f in wake:
            os.close(f)
        rc = _child(req)
    except SystemExit as exc:
        rc = exit_code(exc.code)
    except BaseException:  # as a fresh interpreter's: the process's hook says it (refusal's one line)
        sys.excepthook(*sys.exc_info())
    finally:
        end(rc)  # threads joined and exit handlers run, as a fresh interpreter's exit would


def _serve(preload: Sequence[str]) -> int:
    for name in preload:
        importlib.import_module(name)
    threads = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else 1
    if threads != 1:
        sys.stderr.write(f"fork server: {threads} threads after importing {', '.join(preload)}; forking is unsafe\n")
        return 3
    wake = os.pipe()
    os.set_blocking(wake[1], False)
    signal.set_wakeup_fd(wake[1])
    signal.signal(signal.SIGCHLD, lambda *_: None)
    out = sys.stdout.buffer

    def reply(msg: Mapping[str, int]) -> None:
        out.write(json.dumps(msg).encode() + b"\n")
        out.flush()

    out.write(_READY)
    out.flush()
    stdin = sys.stdin.buffer.fileno()
    pending = b""
    while True:
        try:
            ready, _, _ = select.select([stdin, wake[0]], [], [])
        except InterruptedError:
            continue
        if wake[0] in ready:
            try:
                os.read(wake[0], 4096)
            except BlockingIOError:
                pass
        while True:  # reap every child that ended
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            reply({"exit": pid, "rc": os.waitstatus_to_exitcode(status)})
        if stdin in ready:
            data = os.read(stdin, 1 << 16)
            if not data:
                return 0
            pending += data
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                req = json.loads(line)
                reply({"id": int(req["id"]), "pid": _fork(req, wake)})


if __name__ == "__main__":
    run_then_exit(lambda: _serve(sys.argv[1:] or PRELOAD))
