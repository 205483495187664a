"""Which keys a process's stores are kept apart by, under each launcher."""

from __future__ import annotations

from meshpact.live.recovery.session import run_id_of


def test_meshpact_launchs_run_id_is_used_as_given():
    env = {"MESHPACT_RUN_ID": "job7", "TORCHELASTIC_RUN_ID": "rdzv", "TORCHELASTIC_RESTART_COUNT": "3"}
    assert run_id_of(env) == "job7"  # its agent never restarts the group: one attempt for the whole run


def test_each_attempt_of_plain_torchrun_has_keys_of_its_own():
    first = run_id_of({"TORCHELASTIC_RUN_ID": "rdzv", "TORCHELASTIC_RESTART_COUNT": "0"})
    again = run_id_of({"TORCHELASTIC_RUN_ID": "rdzv", "TORCHELASTIC_RESTART_COUNT": "1"})
    other_job = run_id_of({"TORCHELASTIC_RUN_ID": "other", "TORCHELASTIC_RESTART_COUNT": "0"})
    assert len({first, again, other_job}) == 3
    assert run_id_of({"TORCHELASTIC_RUN_ID": "rdzv"}) == first  # an agent that sets no count: its first attempt


def test_a_process_started_by_hand_has_the_empty_run_id():
    assert run_id_of({}) == run_id_of({"MESHPACT_RUN_ID": ""}) == ""
