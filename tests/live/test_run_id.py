"""Which keys a process's stores are kept apart by, under each launcher."""

from __future__ import annotations

from meshpact.live.recovery.control import ControlChannel
from meshpact.live.recovery.session import attempt_scope, run_id_of
from meshpact.live.store import host_store
from meshpact.live.recovery.jobkey import draw

KEY = draw("a test's job key")  # the job key the channels of this file sign with

PLAIN = {"TORCHELASTIC_RUN_ID": "rdzv", "TORCHELASTIC_USE_AGENT_STORE": "True"}


def test_meshpact_launchs_run_id_is_used_as_given():
    assert run_id_of({**PLAIN, "MESHPACT_RUN_ID": "job7"}) == "job7"
    assert run_id_of(PLAIN) == "rdzv" and run_id_of({}) == run_id_of({"MESHPACT_RUN_ID": ""}) == ""


def _channel(port: int, rank: int) -> ControlChannel:
    return ControlChannel("127.0.0.1", port, rank, 2, 5.0, run_id="rdzv", key=KEY)


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
    for env in (
        {"TORCHELASTIC_RUN_ID": "rdzv", "TORCHELASTIC_USE_AGENT_STORE": "False"},
        {**PLAIN, "MESHPACT_RUN_ID": "job7"},
        {**PLAIN, "MESHPACT_CONTROL_PORT": "7000"},
    ):
        assert attempt_scope("rdzv", ch, env) == "rdzv"
    del server


def test_plain_torchrun_ranks_find_the_channel_rank_0_hosts_at_a_port_the_kernel_picked():
    """No port is guessed (``MASTER_PORT + 1`` could be taken): rank 0 publishes its channel's
    address and word in the job's store; a record the last attempt left there (its host gone,
    or its port now another attempt's channel) is passed over until this attempt's is written."""
    import json
    import socket
    import threading

    from meshpact.live.recovery.control import ATTEMPT_KEY, join, seal

    name = "meshpact/control-address/rdzv"

    def record(port: int, word: str) -> bytes:  # as the job's rank 0 signs it
        return seal(KEY.derive("control"), name, {"host": "127.0.0.1", "port": port, "word": word})

    env = {"MASTER_ADDR": "127.0.0.1"}
    job_store = host_store("127.0.0.1", 0)
    gone = host_store("127.0.0.1", 0)
    gone_port = gone.port
    del gone  # the last attempt's rank 0: its port refuses now
    job_store.set(name, record(gone_port, "old"))
    other = host_store("127.0.0.1", 0)  # a live channel with another attempt's word
    ControlChannel("127.0.0.1", other.port, 0, 2, 5.0, run_id="rdzv", key=KEY).set(ATTEMPT_KEY, "older")
    joined: list[ControlChannel] = []
    one = threading.Thread(target=lambda: joined.append(join(job_store, 1, 2, 5.0, "rdzv", 10.0, env, key=KEY)))
    one.start()
    one.join(0.3)
    assert one.is_alive()  # still looking: the stale record's host refuses
    job_store.set(name, record(other.port, "old"))
    one.join(0.3)
    assert one.is_alive()  # a channel answers there, but not with the record's word
    # a record without the job's signature naming that channel and its word: passed over, never joined
    job_store.set(name, json.dumps({"host": "127.0.0.1", "port": other.port, "word": "older"}))
    one.join(0.3)
    assert one.is_alive()
    silent = socket.create_server(("127.0.0.1", 0))  # accepts (the kernel's backlog) and never answers
    job_store.set(name, record(silent.getsockname()[1], "old"))
    one.join(0.5)
    assert one.is_alive()
    zero = join(job_store, 0, 2, 5.0, "rdzv", 10.0, env, key=KEY)
    one.join(8.0)  # the silent listener is given up on within 2 s
    assert not one.is_alive() and joined[0].port == zero.port != other.port
    zero.set("k", 7)
    assert joined[0].get("k") == 7 and joined[0].get(ATTEMPT_KEY) == zero.get(ATTEMPT_KEY) != "older"
    silent.close()


def test_a_rank_whose_rank_0_never_publishes_is_told_so_within_its_bound():
    import time

    import pytest

    from meshpact.live.recovery.control import join

    job_store = host_store("127.0.0.1", 0)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="rank 3: rank 0.s control channel for this attempt was not reached"):
        join(job_store, 3, 4, 5.0, "rdzv", 0.5, {"MASTER_ADDR": "127.0.0.1"}, key=KEY)
    assert time.monotonic() - start < 3.0
