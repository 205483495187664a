"""torchtitan's own components recovered whole: a kill, a collective fault and a stall.

``examples/torchtitan_train.py`` trains torchtitan's Llama 3 (a tiny config, FSDP2 over two ranks)
with its ``OptimizersContainer`` (two parameter groups, one Adam and one AdamW inner optimizer),
its ``LRSchedulersContainer`` and its ``dist_mean`` for the logged loss. Three runs go side by
side: plain ``torchrun`` with no fault (the reference); ``meshpact launch`` with a worker killed,
a collective that raises and a stall; plain ``torchrun`` with the collective fault and the stall
(no launcher of Meshpact's: only in-memory recovery). Every rank of both faulted runs must end
with the reference's model shards, the container's own ``state_dict()`` (every inner optimizer's
moments, steps and settings) and learning rates. Before the container's inner optimizers were
read, the killed rank's replacement resumed with fresh moments and both runs still exited 0.
"""

from __future__ import annotations

from pathlib import Path
import json

import pytest

pytest.importorskip("torchtitan", reason="needs the torchtitan extra: pip install -e '.[torchtitan]'")

from meshpact.live.trials.launchdrill import Job  # noqa: E402

pytestmark = [pytest.mark.live, pytest.mark.slow]

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "torchtitan_train.py"
RANKS, STEPS = 2, 8


def _finals(out: Path) -> dict[int, dict]:
    return {
        r: json.loads((out / f"rank{r}.json").read_text()) for r in range(RANKS) if (out / f"rank{r}.json").exists()
    }


def _faults(*specs: str) -> tuple[str, ...]:
    return tuple(arg for spec in specs for arg in ("--fault", spec))


def test_torchtitans_containers_recover_bit_identical_under_meshpact_launch_and_torchrun(tmp_path):
    launch = _faults("kill:2:1", "collective:4:0", "stall:6:1")
    plain = _faults("collective:3:1", "stall:5:0")
    with (
        Job(
            Job.torchrun("--standalone", "--nproc-per-node", str(RANKS)), tmp_path / "reference", STEPS, script=SCRIPT
        ) as ref,
        Job(
            Job.meshpact("--standalone", "--nproc-per-node", str(RANKS), "--max-restarts", "1", warm_start=True),
            tmp_path / "launch",
            STEPS,
            script=SCRIPT,
            script_args=launch,
        ) as job,
        Job(
            Job.torchrun("--standalone", "--nproc-per-node", str(RANKS)),
            tmp_path / "torchrun",
            STEPS,
            script=SCRIPT,
            script_args=plain,
        ) as run,
    ):
        assert ref.wait(400) == 0, ref.tail()
        assert job.wait(400) == 0, job.tail()
        assert run.wait(400) == 0, run.tail()
    reference, launched, plain_run = _finals(ref.out), _finals(job.out), _finals(run.out)
    assert sorted(reference) == sorted(launched) == sorted(plain_run) == list(range(RANKS))
    assert all(not f["recoveries"] for f in reference.values())
    # the schedule moved: the learning rates are mid-decay, each inner optimizer its own
    assert all(0 < f["lr"][0] < 1e-2 and 0 < f["lr"][1] < 3e-3 for f in reference.values())
    for name, faulted in (("launch", launched), ("torchrun", plain_run)):
        for key in ("model", "optimizers", "lr", "digest"):
            assert {r: f[key] for r, f in faulted.items()} == {r: f[key] for r, f in reference.items()}, (name, key)
    # every fault was recovered: the kill by a replacement process, the others in memory
    assert launched[1]["incarnation"] == 1 and launched[0]["incarnation"] == 0
    assert {r["step"] for r in launched[0]["recoveries"]} == {2, 4, 6}, launched[0]["recoveries"]
    assert {r["step"] for r in plain_run[0]["recoveries"]} == {3, 5}, plain_run[0]["recoveries"]
    assert "peer_restore" in {r["policy"] for r in launched[0]["recoveries"]}
