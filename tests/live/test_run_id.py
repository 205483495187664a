"""Which keys a process's stores are kept apart by, under each launcher."""

from __future__ import annotations

from meshpact.live.recovery.control import ControlChannel
from meshpact.live.recovery.session import attempt_scope, run_id_of
from meshpact.live.store import host_store

PLAIN = {"TORCHELASTIC_RUN_ID": "rdzv", "TORCHELASTIC_USE_AGENT_STORE": "True"}


def test_meshpact_launchs_run_id_is_used_as_given():
    assert run_id_of({**PLAIN, "MESHPACT_RUN_ID": "job7"}) == "job7"
    assert run_id_of(PLAIN) == "rdzv" and run_id_of({}) == run_id_of({"MESHPACT_RUN_ID": ""}) == ""


def _channel(port: int, rank: int) -> ControlChannel:
    return ControlChannel("127.0.0.1", port, rank, 2, 5.0, run_id="rdzv")


def test_each_attempt_of_plain_torchrun_sharing_its_agents_store_has_keys_of_its_own():
    """Every rank of an attempt reads the word its rank 0's fresh control channel holds first; the
    next attempt's channel is hosted anew, so its word differs (and torchrun's restart count,
    which two nodes of one attempt can disagree on, is not read at all)."""
    first_attempt, second_attempt = host_store("127.0.0.1", 0), host_store("127.0.0.1", 0)
    a0, a1 = _channel(first_attempt.port, 0), _channel(first_attempt.port, 1)
    one = attempt_scope("rdzv", a0, {**PLAIN, "TORCHELASTIC_RESTART_COUNT": "0"})
    assert attempt_scope("rdzv", a1, {**PLAIN, "TORCHELASTIC_RESTART_COUNT": "1"}) == one != "rdzv"
    a0.set("k", 1)
    assert a1.get("k") == 1  # both channels now keep their keys under the attempt's scope
    two = attempt_scope("rdzv", _channel(second_attempt.port, 0), PLAIN)
    assert two.startswith("rdzv.") and two != one
    del first_attempt, second_attempt


def test_no_word_is_drawn_where_the_store_is_the_attempts_own_or_the_channel_outlives_it():
    server = host_store("127.0.0.1", 0)
    ch = _channel(server.port, 0)
    for env in ({"TORCHELASTIC_RUN_ID": "rdzv", "TORCHELASTIC_USE_AGENT_STORE": "False"},
                {**PLAIN, "MESHPACT_RUN_ID": "job7"}, {**PLAIN, "MESHPACT_CONTROL_PORT": "7000"}):
        assert attempt_scope("rdzv", ch, env) == "rdzv"
    del server
