"""Defaults that survive a lost rank, and the one line of a recovery that cannot happen.

Peer copies are kept by default where a job has peers; a rank refusing a recovery that cannot happen
says it in one line (no traceback) and leaves the marker the launcher's agent reads, in a
process of its own as a rank's script would (that process imports no torch: the hook needs none).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from meshpact.live.recovery.config import RecoveryConfig, TimeoutOrderError
from meshpact.live.recovery.consensus import ConsensusError
from meshpact.live.recovery.refusal import (
    REFUSAL_FILE_ENV,
    REFUSAL_LINE,
    RecoveryImpossible,
    read_refusal,
    without_checkpoint,
)


def test_peer_copies_are_kept_by_default_where_the_job_has_peers_and_off_by_one_setting():
    assert RecoveryConfig().peer_copies is None  # settled once the job's size is known
    assert RecoveryConfig().for_world(4).peer_copies == 1
    assert RecoveryConfig().for_world(2).peer_copies == 1
    assert RecoveryConfig().for_world(1).peer_copies == 0  # nobody to hold a copy
    assert RecoveryConfig(peer_copies=0).for_world(4).peer_copies == 0
    assert RecoveryConfig(peer_copies=2).for_world(4).peer_copies == 2
    assert RecoveryConfig(peer_copy_depth=1).for_world(4).peer_copy_depth == 1
    for bad in (-1, 1.5, "1"):
        with pytest.raises(TimeoutOrderError, match=r"peer_copies must be 0 or more \(0: none kept\)"):
            RecoveryConfig(peer_copies=bad)


def test_every_refusal_of_consensus_is_a_recovery_that_cannot_happen():
    assert issubclass(ConsensusError, RecoveryImpossible) and issubclass(RecoveryImpossible, RuntimeError)
    assert (
        str(without_checkpoint("no peer copies are kept (peer copies: 0)", False))
        == "cannot recover in memory (no peer copies are kept (peer copies: 0)) and no checkpoint directory is set"
    )
    assert str(without_checkpoint("x", True)).endswith("and no complete checkpoint exists")


def _rank(code: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    prelude = "from meshpact.live.recovery.refusal import RecoveryImpossible, install\ninstall()\ninstall()\n"
    return subprocess.run(
        [sys.executable, "-c", prelude + code],
        capture_output=True,
        text=True,
        timeout=60,
        env={**env, "PYTHONPATH": ":".join(sys.path)},
    )


def test_an_uncaught_refusal_is_one_line_and_a_marker_and_any_other_error_keeps_its_traceback(tmp_path):
    marker = tmp_path / "refused"
    out = _rank(
        "raise RecoveryImpossible('rank(s) [2] declared lost,\\n  no replacement comes')",
        {REFUSAL_FILE_ENV: str(marker)},
    )
    line = f"{REFUSAL_LINE}rank(s) [2] declared lost, no replacement comes"
    assert out.returncode == 1
    assert out.stderr == line + "\n"  # one line, said once though the hook was installed twice
    assert read_refusal(marker) == line
    other = _rank("raise ValueError('a bug in the loop')", {REFUSAL_FILE_ENV: str(tmp_path / "other")})
    assert other.returncode == 1 and "Traceback" in other.stderr and "ValueError: a bug in the loop" in other.stderr
    assert read_refusal(tmp_path / "other") is None  # a plain failure: the agent replaces the rank as before
    unnamed = _rank("raise RecoveryImpossible('no copy')", {})  # under plain torchrun: the line alone
    assert unnamed.returncode == 1 and unnamed.stderr == f"{REFUSAL_LINE}no copy\n"


def test_the_agent_reads_a_bounded_first_line_of_a_marker(tmp_path):
    big = tmp_path / "big"
    big.write_bytes(b"x" * (1 << 20) + b"\nsecond")
    assert read_refusal(big) == "x" * 4096
    assert read_refusal(tmp_path / "missing") is None and read_refusal(None) is None
    (tmp_path / "empty").write_text("\n")
    assert read_refusal(tmp_path / "empty") is None
