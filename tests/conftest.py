"""Settings every test file shares: the order in which ``make test``'s workers take the files.

``make test`` runs two workers, each taking a whole file at a time (``--dist loadfile``,
module fixtures such as the dashboard server, Chromium and the spillover runs set up once).
A worker takes the next file when it is free, so a long file taken last leaves the other
worker idle for its length: the files that take longest go first (longest processing time
first), with the files that mostly wait (``MOSTLY_WAITING``) spread among them (``suite_order``),
the rest after them in their usual order. ``--no-loadscope-reorder`` keeps this order (xdist's own reorders by the number of
tests in a file, which put the longest files, each a few long tests, last).

The list is measured (per-file time of one ``make test`` with ``--junitxml``, seconds, on the
2-core machine; a file whose ranks fork from its worker's fork server is quicker where another
file started that server); a file missing from it only runs later, never not at all.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

from _shared import SESSION_DIR_ENV

LONGEST_FIRST = (
    "tests/live/test_launch_nodes.py",  # 75 s: two namespace nodes, each an elastic agent and its workers; node 0 lost;
    # plain torchrun restarting from a checkpoint
    "tests/app/test_browser_live.py",  # 72 s: Chromium runs a kill with replace and with excise from the Live page
    "tests/app/test_browser_layout.py",  # 66 s: every page at 1,024 and 1,400 px, and at scale
    "tests/live/test_spillover_split.py",  # 62 s: every model-split run, then AOTInductor packages
    "tests/live/test_launch.py",  # 55 s: the README's loop three ways at once (torchrun, a kill under the defaults, a kill
    # that cannot be recovered), then two nodes
    "tests/live/test_recovery_compile.py",  # 42 s: torch.compile on every rank, cold cache first
    "tests/app/test_browser.py",  # 37 s: Chromium through every page, replay, scenario errors
    "tests/live/test_recovery_peer_hosts.py",  # 35 s
    "tests/live/test_recovery_user_paths.py",  # 34 s: a reference under torchrun, then a raised and a stalled collective
    # under meshpact launch (the kill case too, once replacements join user groups)
    "tests/live/test_launch_control_plane.py",  # 30 s: the control plane apart, node 0 lost whole and taken by a spare node
    "tests/live/test_launch_spare.py",  # 29 s: three namespace nodes, one a spare node
    "tests/app/test_pages.py",  # 27 s
    "tests/live/test_recovery_kill.py",  # 25 s
    "tests/live/test_torchtitan.py",  # 25 s: three torchtitan runs side by side, a replacement's import
    "tests/live/test_missed_replacement_excision.py",  # 23 s
    "tests/app/test_browser_mesh.py",  # 22 s
    "tests/live/test_timeouts_follow.py",  # 21 s
    "tests/live/test_recovery_hsdp.py",  # 21 s
    "tests/live/test_agentjob.py",  # 19 s
    "tests/live/test_recovery_collective.py",  # 18 s
    "tests/live/test_forkserver.py",  # 17 s
    "tests/live/test_rebind.py",  # 17 s
    "tests/live/test_recovery_excise.py",  # 14 s
    "tests/live/test_recovery_partition.py",  # 12 s
    "tests/live/test_recovery_held.py",  # 12 s
    "tests/live/test_recovery_stall.py",  # 11 s
    "tests/live/test_trial_baselines.py",  # 10 s: a kill trial with its baselines
    "tests/live/test_recovery_stateful.py",  # 10 s: a loader through in-memory, peer restore and excision
    "tests/live/test_spillover_speculative.py",  # 10 s
    "tests/live/test_checkpoint_dcp.py",  # 9 s: a kill restored past a checkpoint with a flipped bit, then a plain FSDP2
    # loop on the job's checkpoints
    "tests/simulator/test_sim_live_replay.py",  # 6 s
    "tests/live/test_spillover.py",  # 4 s
    "tests/live/test_recovery_user_groups.py",  # 4 s: two kills, each replacement joining the user's groups
    "tests/live/test_spillover_compiled.py",  # 3 s
    "tests/live/test_peer_security_live.py",  # 2 s: 3 ranks attacked, one killed at depth 1
    "tests/live/test_bridge_qwen.py",  # 1 s
    "tests/live/test_recovery_stuck_send.py",  # 0 s
    "tests/live/test_recovery_large_send.py",  # 0 s: a 128 MB send in flight when a recovery starts
)
# The files that mostly wait (a timeout, a silent rank, a socket): 0.0-2.4 s of CPU in 1.4-9.4 s. Taken
# together (after the long files, or last) they left both cores idle at once; each placed after a
# long file, the other worker's live test uses the core it leaves.
MOSTLY_WAITING = (
    "tests/live/test_consensus.py",  # 9 s, 0.3 s of CPU
    "tests/app/test_live_control.py",  # 7.5 s, 2.4
    "tests/live/test_peer_security.py",  # 6 s, 1.7
    "tests/live/test_heartbeat_watch.py",  # 4 s, 0.3
    "tests/live/test_run_id.py",  # 3.5 s, 0.1
    "tests/live/test_netns.py",  # 3.4 s, 0.3
    "tests/live/test_standby.py",  # 1.4 s, 0.0
    "tests/cli/test_exiting.py",  # 1.8 s, 0.2
)


def suite_order() -> tuple[str, ...]:
    """LONGEST_FIRST with one file of MOSTLY_WAITING after every third long file from the fourth on,
    the waiting files left over at the end."""
    order: list[str] = []
    waiting = list(MOSTLY_WAITING)
    for i, path in enumerate(LONGEST_FIRST):
        order.append(path)
        if i >= 3 and i % 3 == 0 and waiting:
            order.append(waiting.pop(0))
    return (*order, *waiting)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {path: i for i, path in enumerate(suite_order())}
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
