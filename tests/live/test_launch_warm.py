"""``meshpact launch --warm-start``: every worker and warm spare of a node forked from one process.

A plain script (no Meshpact in it) runs on one node of two workers; each worker writes who it is
(its pid, its parent, ``sys.argv``, ``__name__``, the all-reduce it took part in) and says a
line on stdout and on stderr. With ``--warm-start`` both workers are children of one process, the
node's fork server (not the launcher), and their output reaches the launcher's as a fresh
worker's would; without it each is the launcher's own child. A spare forked from the server is
promoted to a worker that exits at its start, and the job ends whole.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from meshpact.live.launch.warmspare import runnable

pytestmark = [pytest.mark.live, pytest.mark.slow]

JOB = """
import json, os, sys
from pathlib import Path
import torch, torch.distributed as dist

out = Path(sys.argv[sys.argv.index("--out") + 1])
incarnation = int(os.environ.get("MESHPACT_INCARNATION", "0"))
if os.environ["RANK"] == "1" and "--exit-first" in sys.argv and incarnation == 0:
    sys.exit(7)  # before the group: its replacement joins the rendezvous in its place
print("stdout of rank", os.environ["RANK"], flush=True)
print("stderr of rank", os.environ["RANK"], file=sys.stderr, flush=True)
dist.init_process_group("gloo")
t = torch.full((2,), float(dist.get_rank() + 1))
dist.all_reduce(t)
(out / f"rank{dist.get_rank()}.json").write_text(json.dumps({
    "pid": os.getpid(), "ppid": os.getppid(), "argv": sys.argv, "name": __name__, "sum": t.tolist(),
    "incarnation": incarnation}))
dist.destroy_process_group()
"""


def _launch(
    tmp: Path, *flags: str, script_args: tuple[str, ...] = ()
) -> tuple[subprocess.CompletedProcess, dict[int, dict], int]:
    script = tmp / "job.py"
    script.write_text(JOB)
    out = tmp / "out"
    out.mkdir()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "meshpact.launch",
            "--standalone",
            "--nproc-per-node",
            "2",
            *flags,
            str(script),
            "--out",
            str(out),
            "--tag",
            "x y",
            *script_args,
        ],
        cwd=tmp,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    stdout, stderr = proc.communicate(timeout=240)
    done = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    ranks = {r: json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1) if (out / f"rank{r}.json").exists()}
    return done, ranks, proc.pid


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def test_warm_start_forks_both_workers_from_one_server_and_their_output_reaches_the_launchers(tmp_path):
    done, ranks, launcher = _launch(tmp_path, "--warm-start")
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(ranks) == [0, 1], done.stderr[-3000:]
    parents = {r["ppid"] for r in ranks.values()}
    assert len(parents) == 1 and launcher not in parents, ranks  # one parent, and it is not the launcher
    for r, got in ranks.items():
        assert got["argv"][1:] == ["--out", str(tmp_path / "out"), "--tag", "x y"] and got["name"] == "__main__"
        assert got["argv"][0].endswith("job.py") and got["sum"] == [3.0, 3.0]
        assert f"stdout of rank {r}" in done.stdout and f"stderr of rank {r}" in done.stderr
    assert "--warm-start" not in done.stderr  # nothing fell back to a fresh start


def test_without_warm_start_each_worker_is_the_launchers_own_child(tmp_path):
    done, ranks, launcher = _launch(tmp_path)
    assert done.returncode == 0 and sorted(ranks) == [0, 1], done.stderr[-3000:]
    assert {r["ppid"] for r in ranks.values()} == {launcher}


def test_a_spare_forked_from_the_server_takes_the_rank_of_a_worker_that_exits_at_its_start(tmp_path):
    done, ranks, launcher = _launch(
        tmp_path, "--warm-start", "--spare-ranks-per-node", "1", script_args=("--exit-first",)
    )
    assert done.returncode == 0 and sorted(ranks) == [0, 1], done.stderr[-3000:]
    assert ranks[1]["incarnation"] == 1 and ranks[0]["incarnation"] == 0
    assert ranks[1]["ppid"] == ranks[0]["ppid"] != launcher  # the spare, too, is the server's child
    assert f"replaced by pid {ranks[1]['pid']} (a warm spare" in done.stderr, done.stderr[-3000:]


def test_warm_start_with_no_python_is_refused_in_one_line(tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "meshpact.launch",
            "--standalone",
            "--nproc-per-node",
            "1",
            "--warm-start",
            "--no-python",
            "true",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0 and "Traceback" not in done.stderr
    said = [ln for ln in done.stderr.splitlines() if "--warm-start" in ln]
    assert len(said) == 1 and "--no-python" in said[0], done.stderr


def test_runnable_takes_torchruns_forms_and_no_other_interpreter_option():
    assert runnable(["-u", "train.py", "--lr", "1"]) and runnable(["-u", "-m", "pkg.train", "-x"])
    assert runnable(["train.py"])
    assert not runnable(["-u"]) and not runnable(["-u", "-m"]) and not runnable(["-X", "dev", "train.py"])
    assert not runnable(["-m", "-c"])
