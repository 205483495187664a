"""A checkpoint is restored only as it was written: a flipped bit or a torn file is refused and the
newest older complete checkpoint restores bit for bit, by name; a save killed with SIGKILL at any
point leaves nothing ``latest()`` picks, and the next start removes what it left."""

from __future__ import annotations

import logging
import os
import random
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from meshpact.core.errors import MeshpactError
from meshpact.core.recovery import Policy
from meshpact.live.recovery import checkpoint as ckpt_mod
from meshpact.live.recovery.checkpoint import Checkpointer, CheckpointCorrupt
from meshpact.live.recovery.consensus import Proposal, decide

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

_WORLD = 2


def _state(step: int, rank: int) -> dict[str, torch.Tensor]:
    """A job state whose every value differs by step and rank, NaN and -0.0 included (``torch.equal``
    alone would call a NaN unequal; the bytes are compared too)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    w = torch.randn(33, 7, generator=g)
    w[0, 0], w[0, 1] = float("nan"), -0.0
    return {
        "param/w": w,
        "optim/w/exp_avg": torch.randn(33, 7, generator=g, dtype=torch.float64),
        "optim/w/step": torch.tensor(float(step)),
        "rng/torch_cpu": torch.randint(0, 255, (5056,), generator=g, dtype=torch.uint8),
    }


def _same_bytes(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype
        and a[k].shape == b[k].shape
        and a[k].reshape(-1).view(torch.uint8).equal(b[k].reshape(-1).view(torch.uint8))
        for k in a
    )


@pytest.fixture(scope="module")
def _pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Steps 0, 5 and 10 of two ranks, written once for the module (each test damages a copy)."""
    root = tmp_path_factory.mktemp("pristine")
    ranks = [Checkpointer(root, r, _WORLD, every=5) for r in range(_WORLD)]
    for step in (0, 5, 10):
        for c in ranks:
            c.save(step, _state(step, c.rank))
    return root


@pytest.fixture
def saved(tmp_path: Path, _pristine: Path) -> Path:
    shutil.copytree(_pristine, tmp_path, dirs_exist_ok=True)
    return tmp_path


def _data_file(part: Path) -> Path:
    return next(f for f in part.iterdir() if f.suffix == ".distcp")


def _flip_one_bit(path: Path, rng: random.Random) -> int:
    data = bytearray(path.read_bytes())
    at = rng.randrange(len(data) * 8)
    data[at // 8] ^= 1 << (at % 8)
    mtime = path.stat().st_mtime_ns
    path.write_bytes(bytes(data))
    os.utime(path, ns=(mtime, mtime))  # bit rot leaves the time as it was
    return at


def _restores_older_step(tmp_path: Path, broken: str, caplog: pytest.LogCaptureFixture) -> None:
    """Step 10 is passed over by name, refused where read, and step 5 restores bit for bit."""
    fresh = [Checkpointer(tmp_path, r, _WORLD, every=5) for r in range(_WORLD)]
    assert fresh[0].latest(12, verify=False) == 10  # bookkeeping reads nothing: the damage is not seen there
    with caplog.at_level(logging.WARNING, logger=ckpt_mod.__name__):
        found = fresh[0].latest(12)
    assert found == 5 and len(found.passed_over) == 1 and found.passed_over[0].startswith("step 10 (")
    assert broken in found.passed_over[0]
    lines = [r.getMessage() for r in caplog.records if r.name == ckpt_mod.__name__]
    assert len(lines) == 1 and "step 10" in lines[0] and "using step 5" in lines[0] and "\n" not in lines[0]
    for c in fresh:
        assert _same_bytes(c.load(found), _state(5, c.rank))


@pytest.mark.parametrize("target", ["rank1/data", "rank0/.metadata", ".metadata", "rank0/manifest.json"])
def test_a_flipped_bit_anywhere_is_refused_and_the_older_step_restores_bit_identical(saved, caplog, target):
    tmp_path = saved
    step = tmp_path / "step00000010"
    path = _data_file(step / "rank1") if target == "rank1/data" else step / target
    _flip_one_bit(path, random.Random(target))
    name = str(path.relative_to(step))
    _restores_older_step(tmp_path, name if target != "rank0/manifest.json" else "rank0/manifest.json", caplog)
    if target.startswith("rank"):  # the damaged part's own load refuses it, naming the file, in one line
        rank = int(target[4])
        with pytest.raises(CheckpointCorrupt, match=r"step 10 .*(digest|manifest)") as info:
            Checkpointer(tmp_path, rank, _WORLD, 5).load(10)
        assert "\n" not in str(info.value)
    else:  # the parts are sound: only the step's own files were hit
        assert _same_bytes(Checkpointer(tmp_path, 1, _WORLD, 5).load(10), _state(10, 1))


@pytest.mark.parametrize("cut", ["one byte", "half", "gone"])
def test_a_truncated_or_missing_file_is_refused_and_the_older_step_restores_bit_identical(saved, caplog, cut):
    tmp_path = saved
    path = _data_file(tmp_path / "step00000010" / "rank0")
    size = path.stat().st_size
    if cut == "gone":
        path.unlink()
    else:
        with open(path, "r+b") as f:
            f.truncate(size - 1 if cut == "one byte" else size // 2)
    _restores_older_step(tmp_path, f"rank0/{path.name}", caplog)
    with pytest.raises(CheckpointCorrupt, match="missing" if cut == "gone" else "torn or truncated"):
        Checkpointer(tmp_path, 0, _WORLD, 5).load(10)


def test_a_recovery_decision_names_the_checkpoint_it_passed_over(saved):
    tmp_path = saved
    _flip_one_bit(_data_file(tmp_path / "step00000010" / "rank1"), random.Random(3))
    props = {r: Proposal(r, 2, 11, f"c{r}", True) for r in range(_WORLD)}
    props[1] = Proposal(1, 2, -1, "", False, incarnation=1)  # a replacement: nothing in memory
    d = decide(props, _WORLD, 2, 3, Checkpointer(tmp_path, 0, _WORLD, 5).latest)
    assert d.policy is Policy.CHECKPOINT_RESTORE and d.step == 5 and type(d.step) is int
    assert "passed over step 10" in d.reason and "rank1/" in d.reason and "digest" in d.reason
    for step in (5, 10):  # every checkpoint damaged: nothing to restore, and the reason says why
        _flip_one_bit(_data_file(tmp_path / f"step{step:08d}" / "rank0"), random.Random(step))
    d = decide(props, _WORLD, 2, 4, Checkpointer(tmp_path, 0, _WORLD, 5).latest)
    assert d.step == 0 and "step 10" in d.reason and "step 5" in d.reason
    (tmp_path / "step00000000" / "manifest.json").unlink()
    (tmp_path / "step00000000" / "rank1" / "manifest.json").unlink()
    d = decide(props, _WORLD, 2, 5, Checkpointer(tmp_path, 0, _WORLD, 5).latest)
    assert d.step == -1 and "no checkpoint to restore" in d.reason and "no finished part of rank(s) [1]" in d.reason


def test_storage_that_dcp_cannot_read_is_one_clear_error_not_a_checkpoint_exception(saved):
    """DCP's ``CheckpointException`` is a ``BaseException``: ``except Exception`` misses it."""
    from torch.distributed.checkpoint.api import CheckpointException

    tmp_path = saved
    assert not issubclass(CheckpointException, Exception)
    rank0 = Checkpointer(tmp_path, 0, _WORLD, 5)
    part = rank0.path(0)
    data = _data_file(part)
    data.write_bytes(b"\0" * data.stat().st_size)  # a file DCP cannot read, its manifest rewritten to match
    from meshpact.live.recovery.manifest import digest_file, read_manifest, write_manifest

    files = read_manifest(part)
    files[data.name] = digest_file(data)
    write_manifest(part, files)
    with pytest.raises(CheckpointCorrupt, match="cannot be read back") as info:
        rank0.load(0)
    assert isinstance(info.value, MeshpactError) and "\n" not in str(info.value)
    # a plain loop's checkpoint (no manifest to check) torn: the same one line
    plain = tmp_path / "plain" / "step00000003"
    dcp.save({"model.w": torch.arange(12.0).reshape(4, 3)}, checkpoint_id=str(plain), no_dist=True)
    data = _data_file(plain)
    with open(data, "r+b") as f:
        f.truncate(data.stat().st_size // 2)
    with pytest.raises(CheckpointCorrupt, match="cannot be read back"):
        Checkpointer(tmp_path / "plain", 0, 1, 1).load(3, like={"param/w": torch.empty(4, 3)})


# -- a save killed with SIGKILL ---------------------------------------------------------------
def _big_state() -> dict[str, torch.Tensor]:
    return {f"param/w{i}": torch.full((4 << 20,), float(i)) for i in range(6)}  # 96 MiB: a write that takes a while


def _killed_save(tmp_path: Path, step: int, at: str) -> None:
    """Fork a process that saves ``step`` and is killed with SIGKILL ``at`` one point of the save:
    ``mid-write`` (by the parent, once the part's temporary folder appears) or, by itself, just
    before the part's manifest, just before the merge, or just before the step's manifest."""
    pid = os.fork()
    if pid == 0:  # the saving process: never returns to pytest
        try:
            # one thread: a forked child has none of the parent's OpenMP pool, and a parallel op here
            # (the big state's fill) waits for those threads for ever once the parent has used the pool
            torch.set_num_threads(1)
            if at != "mid-write":
                real_manifest, real_merge = ckpt_mod.write_manifest, ckpt_mod._merge

                def die() -> None:
                    os.kill(os.getpid(), signal.SIGKILL)

                def write_manifest(folder, files):
                    if (at == "part manifest") == folder.name.startswith(".rank"):
                        die()
                    real_manifest(folder, files)

                def merge(top, world):
                    if at == "merge":
                        die()
                    real_merge(top, world)

                ckpt_mod.write_manifest, ckpt_mod._merge = write_manifest, merge
            Checkpointer(tmp_path, 0, 1, 1).save(step, _big_state() if at == "mid-write" else _state(10 * step, 0))
        finally:
            os._exit(0)
    if at == "mid-write":
        deadline = time.monotonic() + 60
        while not any(p.name.startswith(".rank0~") for p in (tmp_path / f"step{step:08d}").glob(".*")):
            if time.monotonic() > deadline:  # the child is killed either way: none is left behind
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                pytest.fail("the save never began within 60 s")
            time.sleep(0.001)
        os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, f"the save was not killed ({status})"


@pytest.mark.parametrize(
    ("at", "rewrite"),
    [(at, False) for at in ("mid-write", "part manifest", "merge", "step manifest")]
    + [("mid-write", True), ("part manifest", True)],
)
def test_a_save_killed_at_any_point_leaves_nothing_torn_for_latest_and_the_next_start_cleans_up(tmp_path, at, rewrite):
    """Killed before its part is in place, the save is as if it never began: a new step is not
    picked, a rewritten one keeps its earlier whole part. Killed after, the part is whole and
    durable, and the step is completed by whoever finds every part (here ``latest`` itself)."""
    for step in (0, 1, 2) if rewrite else (0, 1):
        Checkpointer(tmp_path, 0, 1, 1).save(step, _state(step, 0))
    _killed_save(tmp_path, 2, at)
    temps = sorted(p.name for p in (tmp_path / "step00000002").iterdir() if "~" in p.name)
    if at in ("mid-write", "part manifest"):
        assert temps, f"the save left no temporary folder: it was not killed while writing ({at})"
    fresh = Checkpointer(tmp_path, 0, 1, 1)
    assert sorted(p.name for p in fresh.cleaned) == temps
    assert not [p for p in (tmp_path / "step00000002").iterdir() if "~" in p.name]
    if at in ("merge", "step manifest"):
        assert fresh.latest(5) == 2 and _same_bytes(fresh.load(2), _state(20, 0))
    elif rewrite:
        assert fresh.latest(5) == 2 and _same_bytes(fresh.load(2), _state(2, 0))
    else:
        assert fresh.latest(5) == 1 and _same_bytes(fresh.load(1), _state(1, 0))
        fresh.save(2, _state(2, 0))  # the step is written again, whole
        assert fresh.latest(5) == 2 and _same_bytes(fresh.load(2), _state(2, 0))


def test_a_live_writers_temporary_folder_is_left_alone(tmp_path):
    step = tmp_path / "step00000004"
    live = ckpt_mod.temp_path(step / "rank1", "tmp")  # this very process: alive
    live.mkdir(parents=True)
    other_host = step / ".rank0~elsewhere.example~1~1~tmp"
    other_host.mkdir()
    assert Checkpointer(tmp_path, 0, 2, 1).cleaned == [] and live.exists() and other_host.exists()


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"not json",
        b"[" * 100_000 + b"]" * 100_000,
        b'{"format": "other", "files": {}}',
        b'{"format": "meshpact-checkpoint-manifest/1", "files": {"../../etc/passwd": [1, "' + b"0" * 64 + b'"]}}',
        b'{"format": "meshpact-checkpoint-manifest/1", "files": {"a": [-1, "' + b"0" * 64 + b'"]}}',
        b'{"format": "meshpact-checkpoint-manifest/1", "files": {"a": [1e309, "x"]}}',
    ],
    ids=["empty", "not json", "deep nesting", "other format", "outside the folder", "negative size", "infinite size"],
)
def test_a_hostile_manifest_is_one_line_refusal_and_the_step_is_passed_over(saved, body):
    tmp_path = saved
    (tmp_path / "step00000005" / "manifest.json").write_bytes(body)
    found = Checkpointer(tmp_path, 0, _WORLD, 5).latest(9)
    assert found == 0 and "manifest" in found.passed_over[0] and "\n" not in found.passed_over[0]
    (tmp_path / "step00000005" / "rank1" / "manifest.json").write_bytes(body)
    with pytest.raises(CheckpointCorrupt, match="manifest") as info:
        Checkpointer(tmp_path, 1, _WORLD, 5).load(5)
    assert "\n" not in str(info.value)
