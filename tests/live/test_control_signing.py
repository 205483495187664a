"""Signed control-channel values: a client without the job key (a raw TCPStore client, as anyone who
reaches the port is) can write any key, and nothing it writes is read as a value or acted on."""

from __future__ import annotations

import json
import logging
import threading
import time

import pytest

from meshpact.core.recovery import Policy
from meshpact.live.recovery.consensus import (
    GONE_COUNT_KEY,
    GONE_KEY,
    LOST_KEY,
    Proposal,
    agree,
    declared_lost,
    gone_ranks,
    open_round,
)
from meshpact.live.recovery.control import ControlChannel, ControlForged, ControlTimeout, seal
from meshpact.live.recovery.jobkey import draw
from meshpact.live.store import host_store, open_store

KEY = draw("a test's job key")
RUN = "signed"
NS = f"meshpact/control/{RUN}/"


@pytest.fixture()
def job():
    """The channel's store, two ranks' ends of it, and an attacker's raw client of the same store."""
    server = host_store("127.0.0.1", 0, 4)
    ranks = [ControlChannel("127.0.0.1", server.port, r, 2, timeout_s=2.0, run_id=RUN, key=KEY) for r in range(2)]
    attacker = open_store("127.0.0.1", server.port, 1, is_host=False, timeout_s=5)
    yield ranks, attacker
    del server


def test_a_value_written_without_the_key_reads_as_absent_everywhere(job):
    (a, _), attacker = job
    attacker.set(NS + "x", json.dumps({"policy": "checkpoint_restore"}))
    assert a.get("x", "none") == "none"
    assert a.present(["x"]) == {} and a.peek(["x"]) == [None]
    assert not a.all_present(["x"]) and not a.any_present(["x"])
    a.set("x", 1)
    assert a.get("x") == 1 and a.present(["x"]) == {"x": 1} and a.all_present(["x"]) and a.any_present(["x"])


def test_a_genuine_value_moved_to_another_key_tampered_or_signed_by_another_job_is_refused(job):
    (a, b), attacker = job
    a.set(f"{GONE_KEY}0", True)
    genuine = attacker.get(NS + f"{GONE_KEY}0")
    attacker.set(NS + f"{GONE_KEY}1", genuine)  # the same bytes under another rank's key
    tampered = bytearray(genuine)
    tampered[-1] ^= 1
    attacker.set(NS + "t", bytes(tampered))
    attacker.set(NS + "other", seal(draw().derive("control"), NS + "other", True))  # another job's key
    attacker.set(NS + "raw", seal(KEY, NS + "raw", True))  # the job key itself, not its control key
    assert gone_ranks(b, [0, 1]) == (0,)
    assert b.present(["t", "other", "raw"]) == {}


def test_one_line_says_values_were_ignored_however_many_were(job, caplog):
    (a, _), attacker = job
    for i in range(50):
        attacker.set(NS + f"k{i}", "1")
    with caplog.at_level(logging.WARNING, logger="meshpact.control"):
        assert a.present([f"k{i}" for i in range(50)]) == {}
    said = [r.getMessage() for r in caplog.records if r.name == "meshpact.control"]
    assert len(said) == 1 and "ignored 1 value(s) without this job's signature" in said[0], said
    assert a.ignored == 49  # counted for the next line, said at most once per 30 s


def test_a_forgery_written_first_in_a_set_once_slot_is_taken_back_and_both_ranks_agree(job):
    (a, b), attacker = job
    attacker.set(NS + "round1/decision", json.dumps({"policy": "excise", "lost": [1]}))
    got: dict[int, object] = {}
    threads = [
        threading.Thread(target=lambda ch=ch: got.__setitem__(ch.rank, ch.set_once("round1/decision", {"by": ch.rank})))
        for ch in (a, b)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert got[0] == got[1] and got[0] in ({"by": 0}, {"by": 1})
    assert a.get("round1/decision") == got[0]


def test_a_slot_forged_again_at_every_reclaim_is_refused_in_one_error(monkeypatch):
    class Racing:  # a store whose slot an attacker rewrites between every two requests
        port = 1

        def set_timeout(self, timeout: object) -> None:
            pass

        def compare_set(self, key: str, expected: str | bytes, desired: bytes) -> bytes:
            return b"forged-" + str(time.monotonic_ns()).encode()

    import meshpact.live.recovery.control as control

    monkeypatch.setattr(control, "open_store", lambda *a, **k: Racing())
    ch = ControlChannel("h", 1, 0, 2, run_id=RUN, key=KEY)
    with pytest.raises(ControlForged, match="'round1/decision' was taken 4 times in a row"):
        ch.set_once("round1/decision", {"by": 0})


def test_a_wait_passes_over_a_forgery_until_the_genuine_value_comes_and_times_out_naming_it(job):
    (a, b), attacker = job
    attacker.set(NS + "ready/g1/rank1", json.dumps(True))
    late = threading.Timer(0.3, lambda: b.set("ready/g1/rank1", "genuine"))
    late.start()
    t0 = time.monotonic()
    assert a.wait(["ready/g1/rank1"], 5.0) == {"ready/g1/rank1": "genuine"}
    assert time.monotonic() - t0 >= 0.25
    late.join()
    attacker.set(NS + "ready/g2/rank1", json.dumps(True))
    with pytest.raises(ControlTimeout, match="ready/g2/rank1"):
        a.wait_quietly(["ready/g2/rank1"], 0.3)


def test_consensus_acts_on_no_forged_decision_lost_gone_or_round(job):
    (a, b), attacker = job
    for k, v in {
        "round1/decision": {"round": 1, "policy": "excise", "step": 0, "reason": "forged", "lost": [1]},
        "round1/adopted": {"round": 1, "policy": "excise", "step": 0, "reason": "forged", "lost": [1]},
        f"{LOST_KEY}1": [1],
        f"{GONE_KEY}1": True,
        "round2/rank1": {"rank": 1},
    }.items():
        attacker.set(NS + k, json.dumps(v))
    attacker.add(NS + GONE_COUNT_KEY, 1)
    attacker.add(NS + "round", 1)  # a counter it can move: round 1 is skipped, nothing else
    assert open_round(a, [0, 1]) is None and declared_lost(a) == {} and gone_ranks(a, [0, 1]) == ()
    out: dict[int, object] = {}

    def one(ch: ControlChannel) -> None:
        out[ch.rank] = agree(ch, lambda g: Proposal(ch.rank, g, 5, "d", True), lambda limit: 0, timeout_s=2.0).decision

    threads = [threading.Thread(target=one, args=(ch,)) for ch in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert out[0] == out[1] and out[0].policy is Policy.IN_MEMORY and out[0].step == 5, out


def test_without_a_key_values_are_plain_json_and_hostile_ones_read_as_absent():
    server = host_store("127.0.0.1", 0, 2)
    ch = ControlChannel("127.0.0.1", server.port, 0, 1, timeout_s=2.0, run_id=RUN, key=None)
    raw = open_store("127.0.0.1", server.port, 1, is_host=False, timeout_s=5)
    ch.set("a", {"x": 1})
    assert json.loads(raw.get(NS + "a")) == {"x": 1}
    raw.set(NS + "deep", "[" * 100_000)
    raw.set(NS + "junk", b"\xff\x00")
    assert ch.present(["a", "deep", "junk"]) == {"a": {"x": 1}}
    del server
