"""Settings every test file shares: the order in which ``make test``'s workers take the files.

``make test`` runs two workers, each taking a whole file at a time (``--dist loadfile``,
module fixtures such as the dashboard server, Chromium and the spillover runs set up once).
A worker takes the next file when it is free, so a long file taken last leaves the other
worker idle for its length: the files that take longest go first (longest processing time
first), the rest after them in their usual order. ``--no-loadscope-reorder`` keeps this
order (xdist's own reorders by the number of tests in a file, which put the longest files,
each a few long tests, last).

The list is measured (per-file time of one ``make test`` with ``--junitxml``, seconds, on the
2-core machine); a file missing from it only runs later, never not at all.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

from _shared import SESSION_DIR_ENV

LONGEST_FIRST = (
    "tests/app/test_browser_live.py",  # 180 s: Chromium runs a kill with replace and with excise from the Live page
    "tests/live/test_spillover_split.py",  # 152 s: every model-split run, then AOTInductor packages
    "tests/live/test_torchtitan.py",  # 150 s at load 19: three torchtitan runs side by side, a replacement's import
    "tests/app/test_browser_layout.py",  # 130 s: every page at 1,024 and 1,400 px, and at scale
    "tests/live/test_recovery_stateful.py",  # 90-150 s: a loader through in-memory, peer restore and excision
    "tests/live/test_recovery_compile.py",  # 112 s: torch.compile on every rank, cold cache first
    "tests/live/test_recovery_kill.py",  # 110 s
    "tests/live/test_recovery_user_paths.py",  # 80-130 s: a reference under torchrun, then a raised and a stalled
    # collective under meshpact launch (the kill case too, once replacements join user groups)
    "tests/app/test_browser.py",  # 90 s: Chromium through every page, replay, scenario errors
    "tests/live/test_launch_spare.py",  # 45-110 s beside two busy loops: three namespace nodes, one a spare node
    "tests/live/test_launch_control_plane.py",  # 50-147 s at load 15-43 (31-42 s of CPU): the control plane
    # apart, node 0 lost whole and taken by a spare node
    "tests/live/test_launch_nodes.py",  # 120 s: two namespace nodes, each an elastic agent and its workers; node 0
    # lost; plain torchrun restarting from a checkpoint
    "tests/live/test_launch.py",  # 70 s at load 10: the README's loop three ways at once (torchrun, a kill under
    # the defaults, a kill that cannot be recovered), then two nodes
    "tests/live/test_trial_baselines.py",  # 30-80 s under load: a kill trial with its baselines
    "tests/live/test_checkpoint_dcp.py",  # 36-68 s at load 10-17 (32 s before, same load): a kill restored past a
    # checkpoint with a flipped bit, then a plain FSDP2 loop on the job's checkpoints
    "tests/live/test_peer_security_live.py",  # 41-80 s under load 15-18: 3 ranks attacked, one killed at depth 1
    "tests/live/test_recovery_large_send.py",  # 10-30 s: a 128 MB send in flight when a recovery starts
    "tests/live/test_recovery_stuck_send.py",  # 12-30 s
    "tests/live/test_timeouts_follow.py",  # 20-40 s
    "tests/live/test_rebind.py",  # 58 s
    "tests/live/test_recovery_hsdp.py",  # 39 s, and 17 s (load average 21) for a replica excised
    "tests/live/test_missed_replacement_excision.py",  # 50 s
    "tests/app/test_pages.py",  # 50 s
    "tests/live/test_recovery_partition.py",  # 45 s
    "tests/live/test_spillover_speculative.py",  # 44 s
    "tests/live/test_recovery_collective.py",  # 44 s
    "tests/live/test_bridge_qwen.py",  # 43 s
    "tests/live/test_spillover.py",  # 40 s
    "tests/live/test_recovery_peer_hosts.py",  # 38 s
    "tests/app/test_browser_mesh.py",  # 34 s
    "tests/live/test_recovery_excise.py",  # 32 s
    "tests/live/test_recovery_user_groups.py",  # 21-34 s: two kills, each replacement joining the user's groups
    "tests/live/test_forkserver.py",  # 22 s
    "tests/live/test_agentjob.py",  # 17 s
    "tests/live/test_recovery_stall.py",  # 20 s
    "tests/live/test_recovery_held.py",  # 20 s
    "tests/simulator/test_sim_live_replay.py",  # 20 s
    "tests/live/test_spillover_compiled.py",  # 12 s
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    root = config.rootpath

    def place(item: pytest.Item) -> int:
        try:
            return rank.get(item.path.relative_to(root).as_posix(), len(rank))
        except ValueError:  # a path outside the repository
            return len(rank)

    items.sort(key=place)  # stable: within a file, and among the unlisted files, the usual order


# A folder for the runs every test file may share (``tests/_shared.py``): made by the session's
# controller (the only process when there are no workers) and handed to its workers through the
# environment, which they inherit when they start; removed when the controller ends.
def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config, "workerinput") or os.environ.get(SESSION_DIR_ENV):
        return
    os.environ[SESSION_DIR_ENV] = tempfile.mkdtemp(prefix="meshpact-test-session-")
    config.stash[_OWNED] = os.environ[SESSION_DIR_ENV]


def pytest_unconfigure(config: pytest.Config) -> None:
    owned = config.stash.get(_OWNED, None)
    if owned is not None:
        shutil.rmtree(owned, ignore_errors=True)
        os.environ.pop(SESSION_DIR_ENV, None)


_OWNED = pytest.StashKey[str]()
