"""The peer-copy path as an attacker on the same host meets it, without rank processes.

Real peer servers on loopback, attacked with raw sockets in the project's own wire format: a
client without the job key reads nothing and puts nothing; a copy is kept only when its digest
and index hold and its step is one its source could have committed; a copy whose bytes changed
after it arrived is refused on fetch and the next holder's copy is used; a schedule that is a
pickle is refused unread. The fuzz test sends hostile frames (huge lengths, non-finite numbers,
deep nesting, negative dimensions, a trickle, 300 idle connections) and checks the server keeps
serving its genuine copy with its memory bounded (that holder runs in a process of its own, whose
memory and threads are measured alone).
"""

from __future__ import annotations

import json
import os
import pickle
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshpact.live.recovery.jobkey import draw
from meshpact.live.recovery.peers import (
    MAX_HEADER,
    PENDING_MAX,
    PeerAddress,
    PeerError,
    PeerServer,
    copy_digest,
    fetch,
    fetch_first,
    put,
    serialize,
)
from meshpact.live.recovery.state import SCHEDULE_KEY, ScheduleError

KEY = draw().derive("peer")
_CHALLENGE = 40  # the server's first bytes: an 8-byte magic, then its 32-byte nonce


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "param/w": torch.randn(64, 8, generator=g),
        "optim/w/exp_avg": torch.randn(64, 8, generator=g),
        "rng/torch_cpu": torch.randint(0, 255, (16,), dtype=torch.uint8, generator=g),
    }


def _addr(srv: PeerServer, rank: int = 1) -> PeerAddress:
    return PeerAddress(rank, "h", srv.addr, srv.port, 0)


def _read_all(sock: socket.socket, limit_s: float = 5.0) -> bytes:
    """Everything the server sends until it closes (or ``limit_s`` passes)."""
    sock.settimeout(limit_s)
    out = bytearray()
    try:
        while chunk := sock.recv(1 << 16):
            out += chunk
    except (socket.timeout, ConnectionResetError):
        pass
    return bytes(out)


def _frame(header: dict, tag: bytes | None = None, nonce: bytes = b"", key=None) -> bytes:
    raw = json.dumps(header).encode()
    if tag is None:
        tag = (key or KEY).mac(b"request", nonce, raw)
    return struct.pack("!I", len(raw)) + raw + tag


def _attack(srv: PeerServer, header: dict, body: bytes = b"", key=None) -> bytes:
    """Send ``header`` (tagged under ``key``: a stranger's by default) and ``body``; what came back
    after the challenge."""
    with socket.create_connection((srv.addr, srv.port), timeout=5.0) as sock:
        nonce = _read_exact(sock, _CHALLENGE)[8:]
        try:
            sock.sendall(_frame({"nonce": "00" * 32, **header}, nonce=nonce, key=key or draw().derive("peer")) + body)
        except (BrokenPipeError, ConnectionResetError):
            pass
        return _read_all(sock)


def _read_exact(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        assert chunk, f"closed after {len(out)} of {n} bytes"
        out += chunk
    return bytes(out)


class _WritesFile:
    """A pickle whose loading creates ``path`` (what an attacker's schedule would run)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _poisoned(step: int, seed: int, path: Path) -> bytes:
    """A copy of ``_state(seed)`` at ``step`` whose schedule is a pickle that writes ``path``."""
    raw = pickle.dumps(_WritesFile(str(path)))
    return serialize(step, {**_state(seed), SCHEDULE_KEY: torch.frombuffer(bytearray(raw), dtype=torch.uint8)})


@pytest.fixture()
def holder():
    srv = PeerServer("127.0.0.1", timeout_s=1.0, key=KEY)
    put(_addr(srv), 0, 3, serialize(3, _state(3)), 5.0, key=KEY)
    srv.admit_through(4, 1 << 20)  # this rank committed step 3: a source can be one step ahead, no further
    yield srv
    srv.close()


def _genuine(srv: PeerServer) -> bool:
    got, _ = fetch(_addr(srv), 0, 3, 5.0, key=KEY)
    return all(torch.equal(got[k], v) for k, v in _state(3).items())


def test_a_client_without_the_key_reads_nothing_and_puts_nothing(holder, tmp_path):
    before = holder.holds()
    payload = _poisoned(3, 99, tmp_path / "pwned")
    digest = copy_digest([payload])
    for header, body in (
        ({"op": "get", "src": 0, "step": -1, "n": 0}, b""),  # "the newest you hold"
        ({"op": "get", "src": 0, "step": 3, "n": 0}, b""),
        ({"op": "put", "src": 0, "step": 3, "n": len(payload), "digest": digest}, payload),
        ({"op": "put", "src": 0, "step": 10**9, "n": len(payload), "digest": digest}, payload),
    ):
        assert _attack(holder, header, body) == b"", header  # not one byte past the challenge
    # the library's own client with another job's key: refused the same way
    with pytest.raises(PeerError, match="connection closed"):
        fetch(_addr(holder), 0, 3, 5.0, key=draw().derive("peer"))
    with pytest.raises(PeerError):
        put(_addr(holder), 0, 3, payload, 5.0, key=draw().derive("peer"))
    # a tag made for another path (the control channel's key) or without the nonce is refused too
    root = draw()
    srv = PeerServer("127.0.0.1", timeout_s=1.0, key=root.derive("peer"))
    try:
        assert _attack(srv, {"op": "get", "src": 0, "step": 3, "n": 0}, key=root.derive("control")) == b""
    finally:
        srv.close()
    assert holder.holds() == before and _genuine(holder) and not (tmp_path / "pwned").exists()
    assert all("not the job key's" in why for why in holder.refused[-4:])


def test_puts_past_the_step_a_source_can_have_committed_evict_nothing(holder):
    """Even with the key: far-future steps are refused, so they never displace the genuine copies."""
    put(_addr(holder), 0, 4, serialize(4, _state(4)), 5.0, key=KEY)
    for step in (5, 10**6, 10**6 + 1):
        with pytest.raises(PeerError, match=f"step {step}: past step 4"):
            put(_addr(holder), 0, step, serialize(step, _state(step)), 5.0, key=KEY)
    assert holder.holds() == ((0, 3), (0, 4)) and _genuine(holder)


def _reindexed(payload: bytes, old: bytes, new: bytes) -> bytes:
    """``payload`` (a serialized copy) with ``old`` replaced by ``new`` in its index, the index's length fixed."""
    size = struct.unpack("!I", payload[8:12])[0]
    head = payload[12 : 12 + size].replace(old, new, 1)
    return payload[:8] + struct.pack("!I", len(head)) + head + payload[12 + size :]


def test_a_copy_whose_bytes_or_index_do_not_hold_is_refused_and_the_held_one_stays(holder):
    good = serialize(4, _state(4))
    flipped = bytearray(good)
    flipped[-100] ^= 0x10
    cases = (
        (good, copy_digest([flipped]), "fails its digest"),  # sent, then changed in flight
        # negative dimensions whose product is the byte count: refused on put, not at fetch
        (neg := _reindexed(good, b"[64, 8]", b"[-64, -8]"), None, "non-negative"),
        (serialize(2, _state(4)), None, "is of step 2"),
    )  # an index of another step than the header's
    for payload, digest, why in cases:
        with pytest.raises(PeerError, match=why):
            put(_addr(holder), 0, 4, payload, 5.0, key=KEY, digest=digest)
    assert neg != good and holder.holds() == ((0, 3),) and _genuine(holder)


def test_one_flipped_bit_in_a_held_copy_is_refused_and_the_next_holder_gives_it(tmp_path):
    """As a holder's memory might flip it: the fetcher's digest check refuses that copy, the next
    holder's is used bit for bit, the refusal says which and why, and the first holder stops
    offering it (the next round's holds leave it out)."""
    first, second = (PeerServer("127.0.0.1", timeout_s=2.0, key=KEY) for _ in range(2))
    try:
        addresses = {1: _addr(first, 1), 2: _addr(second, 2)}
        for srv in (first, second):
            put(_addr(srv), 0, 5, serialize(5, _state(5)), 5.0, key=KEY)
        first._copies[0][5].payload[-40] ^= 0x01  # one bit of the last tensor's bytes
        state, n, used, refused = fetch_first(addresses, 0, 5, (1, 2), 5.0, key=KEY)
        assert used == 2 and n > 0 and all(torch.equal(state[k], v) for k, v in _state(5).items())
        assert len(refused) == 1 and refused[0].startswith("rank 1:") and "fails its digest" in refused[0]
        deadline = time.monotonic() + 5.0
        while first.holds() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert first.holds() == () and second.holds() == ((0, 5),)
        assert first.dropped() == ((0, 5),)  # the next round's proposal names it
        with pytest.raises(PeerError, match="fails its digest"):  # an excision's own held copy: checked too
            second._copies[0][5].payload[-40] ^= 0x01
            second.held(0, 5)
        assert second.holds() == () and second.dropped() == ((0, 5),)
        with pytest.raises(
            PeerError, match="no holder gave rank 0's copy of step 5: rank 1: .*rank 2: .*holds no copy"
        ):
            fetch_first(addresses, 0, 5, (1, 2), 5.0, key=KEY)
    finally:
        first.close()
        second.close()


def test_a_schedule_that_is_a_pickle_is_refused_unread_naming_its_source(tmp_path):
    """The restore's decoder (peer restore, checkpoint load) and the excision's (adopted objects)."""
    from meshpact.live.recovery.state import _schedule_from, saved_objects

    pickled = torch.frombuffer(bytearray(pickle.dumps(_WritesFile(str(tmp_path / "pwned")))), dtype=torch.uint8)
    for decode, source in (
        (_schedule_from, "rank 1's copy of step 3 from rank 2"),
        (saved_objects, "rank 1's held copy"),
    ):
        with pytest.raises(ScheduleError, match=f"^{source}: its schedule starts .* refused unread$"):
            decode(pickled, source)
    assert not (tmp_path / "pwned").exists()


# -- fuzz ------------------------------------------------------------------------------------------
_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4),
    max_leaves=20,
)
_HOSTILE = {
    "huge length": lambda n: struct.pack("!I", 0xFFFFFFFF - n),
    "a header past 64 KiB": lambda n: struct.pack("!I", MAX_HEADER + 1 + n),
    "Infinity": lambda n: b'{"op": "put", "src": 0, "step": Infinity, "n": NaN}',
    "deep nesting": lambda n: b"[" * (20_000 + n) + b"]" * (20_000 + n),
    "negative n": lambda n: json.dumps({"op": "put", "src": 0, "step": 4, "n": -1 - n, "digest": "00" * 32}).encode(),
    "huge n, no body": lambda n: json.dumps(
        {"op": "put", "src": 0, "step": 4, "n": 1 << (21 + n % 40), "digest": "00" * 32}
    ).encode(),
    "a get of step -1": lambda n: json.dumps({"op": "get", "src": 0, "step": -1}).encode(),
}


def _hostile_frame(kind: str, n: int, nonce: bytes, signed: bool) -> bytes:
    """``kind``'s bytes as a frame: tagged with the job key where ``signed`` (an insider's bad
    frame, which must still be refused), or raw (a stranger's)."""
    raw = _HOSTILE[kind](n)
    if kind in ("huge length", "a header past 64 KiB"):
        return raw
    body = (
        json.dumps({**json.loads(raw), "nonce": "00" * 32}).encode()
        if raw.startswith(b"{") and b"Infinity" not in raw
        else raw
    )
    tag = KEY.mac(b"request", nonce, body) if signed else os.urandom(32)
    return struct.pack("!I", len(body)) + body + tag


# The holder under attack runs in a process of its own, as a rank's server does, so its resident
# memory is its own: measured in the test's process it would count whatever else that process
# (hypothesis, the other tests' leftovers, a pytest worker) allocates meanwhile.
_HOLDER_MAIN = """
import json, sys
from meshpact.live.recovery.jobkey import JobKey
from meshpact.live.recovery.peers import PeerAddress, PeerServer, put, serialize
sys.path.insert(0, sys.argv[2])
from test_peer_security import _state
key = JobKey(bytes.fromhex(sys.argv[1]), "the test's")
srv = PeerServer("127.0.0.1", timeout_s=1.0, key=key)
put(PeerAddress(1, "h", srv.addr, srv.port, 0), 0, 3, serialize(3, _state(3)), 5.0, key=key)
srv.admit_through(4, 1 << 20)
print(srv.port, flush=True)
for line in sys.stdin:  # each line asks for one figure of the holder's
    with open("/proc/self/status") as f:
        status = dict(row.split(":", 1) for row in f)
    print(json.dumps({"holds": srv.holds(), "pending": len(srv._pending), "rss_kib": int(status["VmRSS"].split()[0]),
                      "threads": int(status["Threads"])}), flush=True)
"""


class _HolderProcess:
    """A peer server holding rank 0's copy of step 3 (as the ``holder`` fixture), in a child process."""

    addr = "127.0.0.1"
    timeout_s = 1.0

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _HOLDER_MAIN, KEY.secret.hex(), str(Path(__file__).parent)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.asks, self.answers = self.proc.stdin, self.proc.stdout
        self.port = int(self.answers.readline())

    def figures(self) -> dict:
        self.asks.write("\n")
        self.asks.flush()
        return json.loads(self.answers.readline())

    def holds(self) -> tuple[tuple[int, int], ...]:
        return tuple(tuple(h) for h in self.figures()["holds"])


@pytest.fixture()
def holder_process():
    holder = _HolderProcess()
    yield holder
    holder.asks.close()
    holder.proc.kill()
    holder.proc.wait()


@pytest.mark.slow
def test_hostile_frames_are_each_refused_and_the_genuine_copy_is_still_served(holder_process):
    holder = holder_process
    assert _genuine(holder)  # one genuine fetch first: the memory of serving is counted from here on
    rss0 = holder.figures()["rss_kib"]

    @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(
        kind=st.sampled_from(sorted(_HOSTILE)) | st.just("random JSON") | st.just("random bytes"),
        n=st.integers(0, 1000),
        signed=st.booleans(),
        value=_json_values,
        noise=st.binary(max_size=200),
    )
    def one(kind: str, n: int, signed: bool, value, noise: bytes) -> None:
        with socket.create_connection((holder.addr, holder.port), timeout=5.0) as sock:
            nonce = _read_exact(sock, _CHALLENGE)[8:]
            if kind == "random bytes":
                frame = noise
            elif kind == "random JSON":
                raw = json.dumps(value).encode()
                frame = struct.pack("!I", len(raw)) + raw + (KEY.mac(b"request", nonce, raw) if signed else noise[:32])
            else:
                frame = _hostile_frame(kind, n, nonce, signed)
            try:
                sock.sendall(frame)
                sock.shutdown(socket.SHUT_WR)
            except OSError:  # the server closed first (a reset, or not connected any more)
                pass
            reply = _read_all(sock)
        # nothing, or (to an insider) a refusal: never a state copy's bytes
        assert reply == b"" or (signed and b'"ok": false' in reply and len(reply) < 4096), (kind, reply[:200])
        assert holder.holds() == ((0, 3),)

    one()
    # a trickling sender (a byte every 50 ms, forever) is cut at its frame's deadline, not kept
    with socket.create_connection((holder.addr, holder.port), timeout=5.0) as sock:
        _read_exact(sock, _CHALLENGE)
        t0 = time.monotonic()
        try:
            for b in struct.pack("!I", 100) + b"{" * 100:
                sock.sendall(bytes([b]))
                time.sleep(0.05)
            closed = False
        except (BrokenPipeError, ConnectionResetError):
            closed = True
        assert closed or _read_all(sock, 0.5) == b""
        assert time.monotonic() - t0 < holder.timeout_s + 2.0
    # 300 idle connections: the oldest unauthenticated ones are closed, the genuine copy is still served
    idle = [socket.create_connection((holder.addr, holder.port), timeout=5.0) for _ in range(300)]
    try:
        assert _genuine(holder)
        time.sleep(0.2)
        now = holder.figures()
        assert now["pending"] <= PENDING_MAX and now["threads"] <= PENDING_MAX + 8, now
    finally:
        for sock in idle:
            sock.close()
    assert _genuine(holder) and holder.holds() == ((0, 3),)
    grown = holder.figures()["rss_kib"] - rss0
    assert grown < 64 << 10, f"the holder's resident memory grew by {grown} KiB (at most 64 MiB)"


# -- the schedule's data-only encoding ---------------------------------------------------------------
def _encoded(doc: dict, blob: bytes = b"") -> torch.Tensor:
    """A schedule tensor holding ``doc`` as its JSON and ``blob`` as its bytes, as a forger would write it."""
    raw = json.dumps(doc).encode()
    data = b"MPSCHED1" + len(raw).to_bytes(8, "little") + len(blob).to_bytes(8, "little") + raw + blob
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def test_a_schedule_round_trips_bit_for_bit_and_forged_encodings_are_refused_in_one_line():
    import numpy as np

    from meshpact.live.recovery.state import Schedule, _Raw, _schedule_from, _schedule_tensor

    state = {
        "best": float("inf"),
        "worse": -float("inf"),
        "nan": float("nan"),
        "zero": -0.0,
        1: (0.9, 0.999),
        (2, "k"): [None, True, b"\x00\xff"],
        "lr": torch.tensor(3e-4, dtype=torch.float64),
        "gen": _Raw("uint8", (5,), bytes(range(5))),
        "np": np.float64(0.5),
        "empty": torch.empty(0, 3),
    }
    sched = Schedule(
        ({"lr": 0.1, "betas": (0.9, 0.99), "foreach": None},), (("StepLR", {"last_epoch": 3}),), (("data", state),)
    )
    t = _schedule_tensor(sched)
    back = _schedule_from(t)
    assert torch.equal(_schedule_tensor(back), t)  # bit-identity of the committed schedule
    got = dict(back.objects)["data"]
    assert got[1] == (0.9, 0.999) and got[(2, "k")] == [None, True, b"\x00\xff"] and got["gen"] == state["gen"]
    assert got["best"] == float("inf") and got["nan"] != got["nan"] and str(got["zero"]) == "-0.0"
    assert got["lr"].dtype == torch.float64 and torch.equal(got["lr"], state["lr"]) and got["empty"].shape == (0, 3)
    with pytest.raises(ScheduleError, match=r"holds a set at state\['data'\]\['s'\]"):
        _schedule_tensor(Schedule((), (), (("data", {"s": {1, 2}}),)))
    empty = {"groups": [], "schedulers": [], "objects": [], "values": []}
    forged = {
        "Infinity": _encoded({**empty, "groups": [{"$d": [["lr", float("inf")]]}]}),
        "nests deeper than 64": _encoded({**empty, "groups": json.loads("[" * 100 + "]" * 100)}),
        "not valid JSON": torch.frombuffer(
            bytearray(b"MPSCHED1" + (200_000).to_bytes(8, "little") + bytes(8) + b"[" * 100_000 + b"]" * 100_000),
            dtype=torch.uint8,
        ),
        "tagged objects": _encoded({**empty, "groups": [{"__class__": "os.system"}]}),
        "not a torch dtype": _encoded({**empty, "objects": [["x", {"$tensor": ["Tensor", [1], 0, 4]}]]}, b"abcd"),
        "non-negative": _encoded({**empty, "objects": [["x", {"$tensor": ["float32", [-1, -1], 0, 4]}]]}, b"abcd"),
        "-byte blob": _encoded({**empty, "objects": [["x", {"$b": [0, 1 << 40]}]]}),
        "not hashable": _encoded({**empty, "objects": [["x", {"$d": [[[1, 2], 3]]}]]}),
        "expected groups": _encoded({"groups": []}),
        "claims": torch.frombuffer(
            bytearray(b"MPSCHED1" + (1 << 60).to_bytes(8, "little") + bytes(8)), dtype=torch.uint8
        ),
    }
    for why, tensor in forged.items():
        with pytest.raises(ScheduleError, match=why) as err:
            _schedule_from(tensor, "a checkpoint's rank 3")
        assert str(err.value).startswith("a checkpoint's rank 3: ") and "\n" not in str(err.value)
