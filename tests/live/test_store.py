"""Stores listen on the address they are given, not on every interface."""

from __future__ import annotations

import pathlib

import pytest

from meshpact.live.store import host_store, open_store
from meshpact.live.recovery.jobkey import draw

KEY = draw("a test's job key")  # the job key the channels of this file sign with


def _listening_addresses(port: int) -> set[str]:
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        path = pathlib.Path(table)
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            local, state = fields[1], fields[3]
            addr, port_hex = local.split(":")
            if state == "0A" and int(port_hex, 16) == port:  # 0A: LISTEN
                found.add(addr)
    return found


def test_hosted_store_listens_on_loopback_only_and_serves_clients():
    store = host_store("127.0.0.1", 0, world_size=2, timeout_s=10)
    assert _listening_addresses(store.port) == {"0100007F"}  # 127.0.0.1, little-endian hex
    client = open_store("127.0.0.1", store.port, 2, is_host=False, timeout_s=10)
    store.set("generation", "3")
    assert client.get("generation") == b"3"


def test_a_taken_port_is_reported_with_what_to_do():
    store = host_store("127.0.0.1", 0, timeout_s=5)
    with pytest.raises(OSError, match="pick a free port"):
        host_store("127.0.0.1", store.port, timeout_s=5)


def test_a_control_channel_says_whether_its_host_still_answers():
    """What a rank's last word on a step it cannot recover rests on: a live host answers; once the host
    process's store is gone (the launcher's agent on node 0, or rank 0), the channel says so at once."""
    import gc

    from meshpact.live.recovery.control import ControlChannel

    store = host_store("127.0.0.1", 0, world_size=2, timeout_s=10)
    channel = ControlChannel("127.0.0.1", store.port, 1, 2, 2.0, run_id="t", key=KEY)
    assert channel.answers() and (channel.host, channel.port) == ("127.0.0.1", store.port)
    del store
    gc.collect()
    assert not channel.answers()


def test_a_quiet_wait_returns_what_arrives_late_and_names_what_never_came():
    """The wait a consensus round falls back to after its first slice: the values once every key
    exists (written by another client while it asks), else a ControlTimeout naming the missing keys."""
    import threading
    import time

    from meshpact.live.recovery.control import ControlChannel, ControlTimeout

    store = host_store("127.0.0.1", 0, world_size=2, timeout_s=10)
    waiter = ControlChannel("127.0.0.1", store.port, 1, 2, 2.0, run_id="q", key=KEY)
    writer = ControlChannel("127.0.0.1", store.port, 0, 2, 2.0, run_id="q", key=KEY)
    writer.set("a", {"x": 1})
    late = threading.Timer(0.2, lambda: writer.set("b", [2, 3]))
    late.start()
    t0 = time.monotonic()
    assert waiter.wait_quietly(["a", "b"], timeout_s=10.0) == {"a": {"x": 1}, "b": [2, 3]}
    assert time.monotonic() - t0 >= 0.15  # it waited for the late key rather than returning part of them
    late.join()
    with pytest.raises(ControlTimeout) as missing:
        waiter.wait_quietly(["a", "never"], timeout_s=0.2)
    assert "never" in str(missing.value) and "'a'" not in str(missing.value)


def test_a_large_jobs_polling_wait_asks_the_channel_less_often_the_more_ranks_wait():
    """At 4,096 ranks every rank polling every 5 ms would ask one store 800,000 times a second: a rank
    of a large job asks every world_size / QUIET_ASKS_PER_S seconds, a small job's every 5 ms."""
    import threading
    import time

    from meshpact.live.recovery.control import QUIET_ASKS_PER_S, ControlChannel

    store = host_store("127.0.0.1", 0, world_size=2, timeout_s=10)
    big = ControlChannel("127.0.0.1", store.port, 7, 4096, 2.0, run_id="p", key=KEY)
    small = ControlChannel("127.0.0.1", store.port, 1, 2, 2.0, run_id="p", key=KEY)
    assert big.quiet_every_s == 4096 / QUIET_ASKS_PER_S and small.quiet_every_s == 0.005
    asked = 0
    check = big._store.check

    def counting(keys):  # noqa: ANN001, ANN202
        nonlocal asked
        asked += 1
        return check(keys)

    big._store = type("Counting", (), {"check": staticmethod(counting), "multi_get": big._store.multi_get})()
    late = threading.Timer(0.6, lambda: small.set("late", 1))
    late.start()
    t0 = time.monotonic()
    assert big.wait_quietly(["late"], timeout_s=10.0) == {"late": 1}
    waited = time.monotonic() - t0
    late.join()
    assert asked <= waited / big.quiet_every_s + 2, (asked, waited)  # every 5 ms would be over 100
