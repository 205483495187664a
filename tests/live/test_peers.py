"""Peer-held state without rank processes: placement, the wire, and what consensus decides."""

from __future__ import annotations

import socket
import struct
import time
import json

import pytest
import torch

from meshpact.core.recovery import Policy
from meshpact.live.recovery.consensus import Decision, Proposal, decide
from meshpact.live.recovery.jobkey import draw
from meshpact.live.recovery.peers import (
    Layout,
    PeerAddress,
    PeerCopier,
    PeerError,
    PeerServer,
    Slab,
    copy_digest,
    deserialize,
    fetch,
    placement,
    put,
    serialize,
)

KEY = draw().derive("peer")  # the job's peer key, as start_session derives it


# -- placement -------------------------------------------------------------------------------
def test_placement_is_the_ring_after_the_rank():
    assert [placement(r, 5, 1) for r in range(5)] == [(1,), (2,), (3,), (4,), (0,)]
    assert placement(3, 5, 3) == (4, 0, 1)


def test_placement_prefers_ranks_on_another_host_then_the_ring():
    hosts = ["a", "a", "a", "b", "b", "b"]
    assert placement(0, 6, 1, hosts) == (3,)
    assert placement(0, 6, 4, hosts) == (3, 4, 5, 1)
    assert placement(4, 6, 2, hosts) == (0, 1)
    # every rank is held by K distinct ranks, never itself
    for r in range(6):
        held = placement(r, 6, 3, hosts)
        assert len(set(held)) == 3 and r not in held


@pytest.mark.parametrize("copies", [-1, 4, 9])
def test_placement_refuses_impossible_copy_counts(copies):
    with pytest.raises(ValueError, match="between 0 and 3"):
        placement(0, 4, copies)


# -- decide ------------------------------------------------------------------------------------
def _latest(limit: int) -> int:
    return (limit // 4) * 4


def _survivor(rank: int, step: int = 9, holds=(), own=(8, 9)) -> Proposal:
    return Proposal(rank, 2, step, f"d{rank}", True, holds=tuple(holds), own_steps=tuple(own), host="h")


def _replacement(rank: int) -> Proposal:
    return Proposal(rank, 2, -1, "", False, incarnation=1, host="h")


def test_a_replaced_rank_whose_holder_has_its_newest_copy_is_restored_from_that_peer():
    props = {
        0: _survivor(0, holds=[(3, 9)]),
        1: _replacement(1),
        2: _survivor(2, holds=[(1, 9)]),
        3: _survivor(3, holds=[(2, 9)]),
    }
    d = decide(props, 4, 2, 3, _latest, peer_copies=1)
    assert d.policy is Policy.PEER_RESTORE and d.step == 9
    assert d.restore_from == ((1, 2),) and d.holder_of(1) == 2 and d.holder_of(0) is None
    assert "rank 1 <- rank 2" in d.reason and "keep their state in memory" in d.reason
    assert Decision.from_dict(d.to_dict()) == d


def test_a_copy_still_in_flight_rolls_the_survivors_back_one_step_from_their_own_snapshots():
    props = {0: _survivor(0), 1: _replacement(1), 2: _survivor(2, holds=[(1, 8)]), 3: _survivor(3)}
    d = decide(props, 4, 2, 3, _latest, peer_copies=1)
    assert d.policy is Policy.PEER_RESTORE and d.step == 8
    assert "roll back" in d.reason and "[0, 2, 3]" in d.reason


def test_a_survivor_without_the_needed_snapshot_forces_the_checkpoint():
    props = {0: _survivor(0, own=(9,)), 1: _replacement(1), 2: _survivor(2, holds=[(1, 8)]), 3: _survivor(3)}
    d = decide(props, 4, 2, 3, _latest, peer_copies=1)
    assert d.policy is Policy.CHECKPOINT_RESTORE and d.step == 8
    assert "no step is held for every rank" in d.reason and "rank 0: [9]" in d.reason


def test_a_rank_lost_with_its_holder_is_restored_from_the_checkpoint_and_the_reason_says_so():
    # ranks 1 and its holder 2 both replaced: rank 2's copy survives on rank 3, rank 1's is gone
    props = {0: _survivor(0), 1: _replacement(1), 2: _replacement(2), 3: _survivor(3, holds=[(2, 9)])}
    d = decide(props, 4, 2, 3, _latest, peer_copies=1)
    assert d.policy is Policy.CHECKPOINT_RESTORE and d.step == 8
    assert "state of rank 1 was lost with all its holder(s) [2]" in d.reason
    assert "rank 2" not in d.reason.split("lost with")[0].split("hold no intact")[1]


def test_without_peer_copies_a_replacement_means_a_checkpoint_restore():
    props = {0: _survivor(0, holds=[(1, 9)]), 1: _replacement(1)}
    d = decide(props, 2, 2, 3, _latest, peer_copies=0)
    assert d.policy is Policy.CHECKPOINT_RESTORE and "peer copies: 0" in d.reason


def test_placement_on_two_hosts_is_named_in_the_reason_and_a_live_holder_is_not_called_lost():
    hosts = {0: "a", 1: "a", 2: "b", 3: "b"}
    props = {r: Proposal(r, 2, 9, "x", True, own_steps=(9,), host=hosts[r]) for r in (1, 2, 3)}
    props[0] = Proposal(0, 2, -1, "", False, incarnation=1, host="a")
    d = decide(props, 4, 2, 3, _latest, peer_copies=1)
    # rank 0's holder is rank 2 (the other host), which is alive: its copy never arrived, it was not lost
    assert d.policy is Policy.CHECKPOINT_RESTORE
    assert "state of rank 0: its holder(s) [2] are alive but hold none of it" in d.reason
    assert "lost with" not in d.reason


def test_after_an_excision_the_reason_names_the_holder_of_the_ring_over_the_ranks_left():
    # rank 1 was excised; rank 3's state fails its check and nobody holds a copy: the copier's ring over
    # (0, 2, 3) puts rank 3's copy on rank 0, one of the two holders asked for (K capped at ranks - 1)
    props = {
        0: _survivor(0, holds=[(2, 9)]),
        2: _survivor(2, holds=[(0, 9)]),
        3: Proposal(3, 2, 9, "d3", False, own_steps=(), host="h"),
    }
    d = decide(props, 4, 2, 3, _latest, peer_copies=3, alive=(0, 2, 3))
    assert d.policy is Policy.CHECKPOINT_RESTORE and d.members == (0, 2, 3)
    assert "state of rank 3: its holder(s) [0, 2] are alive but hold none of it" in d.reason


def test_a_holder_replaced_with_the_lost_rank_and_a_live_one_are_each_named_for_what_they_are():
    props = {0: _survivor(0), 1: _replacement(1), 2: _replacement(2), 3: _survivor(3, holds=[(2, 9)])}
    d = decide(props, 4, 2, 3, _latest, peer_copies=2)  # rank 1's copies were to go to ranks 2 and 3
    assert d.policy is Policy.CHECKPOINT_RESTORE
    assert "state of rank 1: its holder(s) [3] are alive but hold none of it, and [2] were lost with it" in d.reason


def test_a_copy_every_holder_refused_sends_the_job_to_the_checkpoint_and_the_reason_names_the_refusals():
    """Holders that dropped a copy failing its digest hold none of it any more; the decision says so."""
    props = {
        0: _survivor(0, holds=[(3, 9)]),
        1: _replacement(1),
        2: Proposal(2, 2, 9, "d2", True, holds=(), own_steps=(8, 9), host="h", refused=((1, 9),)),
        3: _survivor(3, holds=[(2, 9)]),
    }
    d = decide(props, 4, 2, 3, _latest, peer_copies=1)
    assert d.policy is Policy.CHECKPOINT_RESTORE
    assert (
        "state of rank 1: its holder(s) [2] are alive but hold none of it; rank 2 refused its copy of step 9 "
        "(it failed its digest)"
    ) in d.reason
    assert Proposal.from_dict(props[2].to_dict()) == props[2]


def test_excise_is_decided_only_for_declared_ranks_when_the_job_asked_for_it():
    props = {0: _survivor(0), 2: _survivor(2, holds=[(1, 9)]), 3: _survivor(3)}
    assert decide(props, 4, 2, 3, _latest, peer_copies=1, declared=(1,)).policy is Policy.CHECKPOINT_RESTORE
    d = decide(props, 4, 2, 3, _latest, peer_copies=1, on_rank_loss=Policy.EXCISE, declared=(1,))
    assert d.policy is Policy.EXCISE and d.missing == (1,) and d.members == (0, 2, 3) and d.step == 9
    assert d.lost == (1,) and d.restore_from == ((1, 2),)
    not_yet = decide(props, 4, 2, 3, _latest, peer_copies=1, on_rank_loss=Policy.EXCISE, declared=())
    assert not_yet.policy is Policy.CHECKPOINT_RESTORE and not_yet.missing == (1,)


# -- the wire ----------------------------------------------------------------------------------
def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "param/w": torch.randn(37, 5, generator=g, dtype=torch.float64),
        "param/h": torch.randn(300, generator=g).to(torch.bfloat16),
        "optim/w/step": torch.tensor(7.0),
        "rng/torch_cpu": torch.randint(0, 255, (16,), dtype=torch.uint8, generator=g),
        "empty": torch.zeros(0, 3, dtype=torch.int32),
    }


@pytest.fixture()
def server():
    srv = PeerServer("127.0.0.1", timeout_s=5.0, key=KEY)
    yield srv
    srv.close()


def _addr(srv: PeerServer, rank: int = 1) -> PeerAddress:
    return PeerAddress(rank, "h", srv.addr, srv.port, 0)


def test_a_copy_comes_back_bit_for_bit_and_only_the_two_newest_complete_ones_are_kept(server):
    a, b, c = _state(1), _state(2), _state(3)
    put(_addr(server), 3, 5, serialize(5, a), 5.0, key=KEY)
    put(_addr(server), 3, 6, serialize(6, b), 5.0, key=KEY)
    assert server.holds() == ((3, 5), (3, 6))  # the step before stays: a node's other rank may not have 6 out
    put(_addr(server), 3, 7, serialize(7, c), 5.0, key=KEY)
    assert server.holds() == ((3, 6), (3, 7))
    got, n = fetch(_addr(server), 3, 6, 5.0, key=KEY)
    assert n > 0 and got.keys() == b.keys()
    assert all(torch.equal(got[k], b[k]) and got[k].dtype == b[k].dtype for k in b)
    with pytest.raises(PeerError, match="holds no copy of rank 3 at step 5 .*holds step 7"):
        fetch(_addr(server), 3, 5, 5.0, key=KEY)
    with pytest.raises(PeerError, match="holds no copy of rank 0"):
        fetch(_addr(server), 0, 6, 5.0, key=KEY)


def _bits(t: torch.Tensor) -> bytes:
    t = t.resolve_conj().contiguous()
    return t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def test_every_dtype_and_layout_comes_back_bit_for_bit_and_a_torn_copy_is_refused():
    """The copy's bytes are the tensors' own: no value is converted (int64 past 2^53, NaN payloads,
    -0.0, bfloat16, bool, complex under a lazy conjugate, empty, 0-d, transposed)."""
    nan = torch.tensor([0x7FC00001], dtype=torch.int32).view(torch.float32)  # a NaN with a payload
    state = {
        "int64": torch.tensor([2**62 + 1, -(2**53) - 1], dtype=torch.int64),
        "nan": torch.cat([nan, torch.tensor([-0.0])]),
        "bf16": torch.randn(7).to(torch.bfloat16),
        "f16": torch.randn(2, 3).half(),
        "bool": torch.tensor([True, False]),
        "complex": torch.randn(3, dtype=torch.complex64).conj(),
        "empty": torch.empty(0, 4),
        "scalar": torch.tensor(2.5),
        "transposed": torch.arange(12.0).reshape(3, 4).t(),
        "rng/u8": torch.randint(0, 255, (17,), dtype=torch.uint8),
    }
    step, got = deserialize(serialize(9, state))
    assert step == 9 and list(got) == list(state)
    for k, v in state.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
        assert _bits(got[k]) == _bits(v), k
    assert torch.equal(got["transposed"], state["transposed"]) and torch.equal(got["complex"], state["complex"])
    payload = serialize(9, state)
    with pytest.raises(ValueError, match="index describes"):
        deserialize(payload[:-1])
    with pytest.raises(ValueError, match="not a state copy"):
        deserialize(b"PK" + payload[2:])
    # an index that does not describe its own bytes: refused by name, never read as something else
    bad = serialize(9, {"w": torch.zeros(4), "v": torch.ones(2, dtype=torch.int64)})
    for old, new, why in (
        (b'"float32"', b'"float64"', "needs 32"),
        (b'"float32"', b'"matmul!"', "not a torch dtype"),
        (b"[4]", b"[5]", "needs 20"),
        (b"16, 64]", b"16, 12]", "overlapping"),
        (b"16, 64]", b"16, 64}", "index is not JSON"),
        (b"16, 64]", b'16,"x"]', "is not \\[name"),
        (b"[2], 16, 64]", b"[2], 16]    ", "is not \\[name"),
    ):
        with pytest.raises(ValueError, match=why):
            deserialize(bad.replace(old, new, 1))


def test_each_tensor_of_a_copy_lies_aligned_for_its_dtype():
    """Every tensor's bytes start at an offset any dtype can be viewed at, so a commit copies
    into views of one buffer: a 1-byte tensor first must not misalign the float64 after it."""
    state = {
        "u8": torch.tensor([7], dtype=torch.uint8),
        "f64": torch.randn(3, dtype=torch.float64),
        "c128": torch.randn(2, dtype=torch.complex128),
        "b": torch.tensor([True]),
    }
    layout = Layout.of(state)
    assert all(o % 16 == 0 for o in layout.offsets) and layout.offsets == tuple(sorted(layout.offsets))
    slab = Slab(layout)
    slab.fill(list(state.values()))
    assert all(torch.equal(slab.state[k], v) for k, v in state.items())
    # a parameter that requires grad is copied as it is, and the copy records no autograd graph
    w = torch.nn.Parameter(torch.randn(5))
    param = Slab(Layout.of({"w": w}))
    param.fill([w])
    assert torch.equal(param.state["w"], w.detach()) and not param.state["w"].requires_grad
    assert not layout.fits(
        state | {"f64": torch.randn(4, dtype=torch.float64)},
        [*state.values()][:1] + [torch.randn(4, dtype=torch.float64)] + [*state.values()][2:],
    )


def test_a_sender_dying_mid_copy_leaves_the_previous_copy(server):
    put(_addr(server), 2, 4, serialize(4, _state(4)), 5.0, key=KEY)
    payload = serialize(5, _state(5))
    with _put_header(server, 2, 5, payload) as sock:
        sock.sendall(payload[: len(payload) // 2])
    got, _ = fetch(_addr(server), 2, 4, 5.0, key=KEY)
    assert server.holds() == ((2, 4),) and torch.equal(got["param/w"], _state(4)["param/w"])


def test_a_copy_arrives_into_the_oldest_ones_buffer_two_buffers_per_source(server):
    """The third copy overwrites the oldest as it arrives: a source's copies never take a third
    buffer, and a sender dying mid-copy leaves the newer complete one, bit for bit."""
    put(_addr(server), 2, 4, serialize(4, _state(4)), 5.0, key=KEY)
    put(_addr(server), 2, 5, serialize(5, _state(5)), 5.0, key=KEY)
    n = len(serialize(6, _state(6)))
    put(_addr(server), 2, 6, serialize(6, _state(6)), 5.0, key=KEY)
    assert server.holds() == ((2, 5), (2, 6)) and server.peak_bytes == 2 * n
    payload = serialize(7, _state(7))
    with _put_header(server, 2, 7, payload) as sock:  # dies half-way into step 5's buffer
        sock.sendall(payload[: len(payload) // 2])
    deadline = time.monotonic() + 5.0
    while server.holds() != ((2, 6),) and time.monotonic() < deadline:
        time.sleep(0.01)
    got, _ = fetch(_addr(server), 2, 6, 5.0, key=KEY)
    assert server.holds() == ((2, 6),) and torch.equal(got["param/w"], _state(6)["param/w"])


def test_a_copy_being_sent_is_never_overwritten_by_one_arriving(server):
    """A replacement still reading the oldest copy while the source's next one arrives reads
    the bytes it asked for: the arriving copy takes a buffer of its own."""
    big = {"param/w": torch.arange(4 << 20, dtype=torch.float32)}  # 16 MB: the send blocks on an unread socket
    put(_addr(server), 2, 4, serialize(4, big), 5.0, key=KEY)
    put(_addr(server), 2, 5, serialize(5, {"param/w": big["param/w"] + 1}), 5.0, key=KEY)
    with _authenticated(server, {"op": "get", "src": 2, "step": 4, "n": 0}) as reader:
        time.sleep(0.3)  # the server is inside sendall of step 4's buffer, blocked on this unread socket
        put(_addr(server), 2, 6, serialize(6, {"param/w": big["param/w"] + 2}), 5.0, key=KEY)
        assert server.holds() == ((2, 5), (2, 6))
        reader.settimeout(5.0)
        (size,) = struct.unpack("!I", _read(reader, 4))
        reply = json.loads(_read(reader, size))
        _read(reader, 32)  # the reply's tag
        _, got = deserialize(_read(reader, len(serialize(4, big))))
    assert reply["ok"] and reply["step"] == 4 and torch.equal(got["param/w"], big["param/w"])


def _authenticated(server: PeerServer, header: dict) -> socket.socket:
    """A connection to ``server`` that has sent ``header`` as a frame tagged with the job key (any
    body is the caller's to send)."""
    sock = socket.create_connection((server.addr, server.port), timeout=5.0)
    nonce = _read(sock, 40)[8:]  # the challenge: a magic, then the server's nonce
    raw = json.dumps({**header, "nonce": "00" * 32}).encode()
    sock.sendall(struct.pack("!I", len(raw)) + raw + KEY.mac(b"request", nonce, raw))
    return sock


def _put_header(server: PeerServer, src: int, step: int, payload: bytes) -> socket.socket:
    return _authenticated(
        server, {"op": "put", "src": src, "step": step, "n": len(payload), "digest": copy_digest([payload])}
    )


def _read(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        assert chunk, f"closed after {len(out)} of {n} bytes"
        out += chunk
    return bytes(out)


def test_at_depth_one_each_side_keeps_one_buffer_and_a_copy_in_flight_holds_none():
    """peer_copy_depth=1: one own snapshot and one held copy per source, each the newest; the
    next copy arrives into a buffer of its own and displaces the held one only once it is
    complete and verified, so a sender dying mid-copy leaves the held copy as it was."""
    holder, other = PeerServer("127.0.0.1", timeout_s=5.0, depth=1, key=KEY), PeerServer("127.0.0.1", key=KEY)
    try:
        copier = _copier(0, [other, holder], timeout_s=5.0, depth=1)
        states = {step: _state(step) for step in (1, 2, 3)}
        for step, st in states.items():
            copier.commit(step, st)
            assert copier.drain(10) and copier.own_steps() == (step,) and holder.holds() == ((0, step),)
            assert all(torch.equal(copier.own[step][k], st[k]) for k in st)
        n = len(serialize(3, states[3]))
        assert copier.host_bytes() == Layout.of(states[3]).total + other.held_bytes and holder.peak_bytes == 2 * n
        payload = serialize(4, _state(4))
        with _put_header(holder, 0, 4, payload) as sock:
            sock.sendall(payload[: len(payload) // 2])
        time.sleep(0.2)  # the holder sees the sender gone: the copy it held is still the one held
        assert holder.holds() == ((0, 3),) and holder.peak_bytes == 2 * n
        got, _ = fetch(_addr(holder), 0, 3, 5.0, key=KEY)
        assert all(torch.equal(got[k], states[3][k]) for k in got)
        copier.close()
    finally:
        holder.close()
        other.close()
    with pytest.raises(ValueError, match="at least one copy"):
        PeerServer("127.0.0.1", depth=0, key=KEY)


def _mapping_of(address: int) -> str | None:
    """The line of /proc/self/maps whose mapping holds ``address`` (None: nothing is mapped there)."""
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= address < hi:
                return line
    return None


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/maps"), reason="reads /proc/self/maps (Linux)")
def test_snapshots_and_held_copies_of_a_megabyte_or_more_are_mappings_of_their_own_freed_when_dropped(server):
    """An own snapshot's slab and a received copy's buffer lie each in an anonymous mapping of
    their own (never in malloc's heap, whose freed space would otherwise take them), unmapped as
    soon as the last view of it goes."""
    import gc
    import mmap

    from meshpact.live.recovery.peers import host_buffer

    assert isinstance(host_buffer(1 << 20), mmap.mmap) and isinstance(host_buffer(1000), bytearray)
    state = {"w": torch.randn(600, 1000), "b": torch.arange(7, dtype=torch.int64)}  # 2.4 MB
    slab = Slab(Layout.of(state))
    slab.fill(list(state.values()))
    start = slab.flat.data_ptr()
    assert start % mmap.PAGESIZE == 0 and "[heap]" not in _mapping_of(start)  # a mapping's first byte
    del slab
    gc.collect()
    assert _mapping_of(start) is None
    addr = PeerAddress(1, "h", server.addr, server.port, 0)
    put(addr, 0, 5, serialize(5, state), timeout_s=5.0, key=KEY)
    held = server.held(0, 5)
    assert torch.equal(held["w"], state["w"])
    payload = server._copies[0][5].payload
    assert isinstance(payload, mmap.mmap) and len(payload) == len(serialize(5, state))
    at = held["w"].data_ptr()
    assert "[heap]" not in _mapping_of(at)
    del held, payload
    server.forget(0)
    gc.collect()
    assert _mapping_of(at) is None


def test_a_holder_that_is_gone_is_a_peer_error_not_a_hang():
    srv = PeerServer("127.0.0.1", key=KEY)
    address = _addr(srv)
    srv.close()
    with pytest.raises(PeerError, match="rank 1's peer server"):
        put(address, 0, 1, b"x", 1.0, key=KEY)


class _Channel:
    """The two calls the copier makes on the control channel, in memory."""

    def __init__(self, table: dict[str, dict]) -> None:
        self.table = table

    def wait(self, keys, timeout_s=None):
        return {k: self.table[k] for k in keys}


def _copier(rank: int, servers: list[PeerServer], **kw) -> PeerCopier:
    """The copier of ``rank`` in a job whose rank ``r`` serves copies at ``servers[r]``, its holders' addresses read."""
    table = {
        f"peer/rank{r}": {"host": "h", "addr": s.addr, "port": s.port, "incarnation": 0} for r, s in enumerate(servers)
    }
    copier = PeerCopier(rank, len(servers), 1, _Channel(table), servers[rank], **kw)
    copier.refresh()
    return copier


def test_the_copier_ships_each_commit_to_its_holders_and_keeps_its_own_two_newest(server):
    other = PeerServer("127.0.0.1", key=KEY)
    try:
        copier = _copier(0, [other, server, other], timeout_s=5.0)
        states = {step: _state(step) for step in (1, 2, 3)}
        for step, st in states.items():
            copier.commit(step, st, listed_s=0.5)  # the runtime's listing of the state, timed by it
        assert copier.drain(10)
        assert copier.counters.host_copy_s >= 1.5  # priced as the copy's own cost on the training thread
        assert copier.own_steps() == (2, 3) and server.holds() == ((0, 2), (0, 3))
        got, _ = fetch(_addr(server), 0, 3, 5.0, key=KEY)
        assert all(torch.equal(got[k], states[3][k]) for k in got)
        c = copier.counters
        assert c.commits == 3 and c.failed == 0 and c.bytes_sent >= 3 * len(serialize(3, states[3])) - 64
        # the snapshot is a copy: changing the live tensors afterwards does not change it
        states[3]["param/w"].add_(1.0)
        assert not torch.equal(copier.own[3]["param/w"], states[3]["param/w"])
        copier.keep_only(2)
        assert copier.own_steps() == (2,)
        # commits reuse the buffers of snapshots no longer kept: every kept snapshot stays its step's
        more = {2: states[2], **{step: _state(step) for step in range(3, 12)}}
        for step, st in list(more.items())[1:]:
            copier.commit(step, st)
            for kept in copier.own_steps():
                assert all(torch.equal(copier.own[kept][k], more[kept][k]) for k in st), (step, kept)
        assert copier.drain(10) and server.holds() == ((0, 10), (0, 11))
        # the host memory counted is every buffer kept: the two snapshots, the older one's buffer
        # taking the next commit (never a third)
        assert copier.host_bytes() == 2 * Layout.of(more[11]).total + other.held_bytes
        got, _ = fetch(_addr(server), 0, 11, 5.0, key=KEY)
        assert all(torch.equal(got[k], more[11][k]) for k in got)
        # the state's shapes change (an excision reshards it): the copies follow the new shapes
        wider = {k: torch.cat([v, v]) if v.dim() else v for k, v in _state(12).items()}
        copier.commit(12, wider)
        assert all(torch.equal(copier.own[12][k], wider[k]) for k in wider)
        assert all(torch.equal(copier.own[11][k], more[11][k]) for k in wider)
        assert copier.drain(10)
        got, _ = fetch(_addr(server), 0, 12, 5.0, key=KEY)
        assert all(got[k].shape == wider[k].shape and torch.equal(got[k], wider[k]) for k in got)
        copier.close()
    finally:
        other.close()


def test_a_holder_whose_state_is_restored_from_a_checkpoint_takes_the_copies_of_the_steps_after_it(server):
    """A job restarted from its checkpoint (``rt.restore``) jumps from step 0 to the checkpoint's step: a
    peer that committed the step after it first ships a copy this holder must take, not one past the
    newest step it allowed before the restore."""
    source = PeerServer("127.0.0.1", key=KEY)
    try:
        holder = _copier(1, [source, server], timeout_s=5.0)
        holder.commit(0, _state(0))  # the starting state: copies through step 1 are taken
        assert holder.drain(10)
        with pytest.raises(PeerError, match="past step 1"):
            put(_addr(server), 0, 7, serialize(7, _state(7)), 5.0, key=KEY)
        holder.keep_only(6)  # what rt.restore(6) does: the committed state is now step 6's
        put(_addr(server), 0, 7, serialize(7, _state(7)), 5.0, key=KEY)
        assert server.holds() == ((0, 7),)
        with pytest.raises(PeerError, match="past step 7"):  # still no further than a source can be
            put(_addr(server), 0, 8, serialize(8, _state(8)), 5.0, key=KEY)
        holder.close()
    finally:
        source.close()


def test_ranks_all_one_generation_behind_a_round_nobody_acted_on_are_not_stale():
    """A rank died after proposing: the round was decided (the channel's generation moved) but
    its groups were never built, so every survivor still holds the previous generation's state."""
    props = {r: Proposal(r, 1, 9, "x", True, own_steps=(8, 9), host="h") for r in (0, 2, 3)}
    props[1] = Proposal(1, 2, -1, "", False, incarnation=1, host="h")
    props[0] = Proposal(0, 1, 9, "x", True, holds=((1, 9),), own_steps=(8, 9), host="h")
    d = decide(props, 4, 2, 3, _latest, peer_copies=1)
    assert d.policy is Policy.PEER_RESTORE and d.step == 9 and d.restore_from == ((1, 0),)
    props[3] = Proposal(3, 0, 9, "x", True, own_steps=(9,), host="h")  # one rank truly behind
    assert "stale generation: rank(s) {3: 0}" in decide(props, 4, 2, 3, _latest, peer_copies=1).reason


def test_the_trial_reports_peer_copy_cost_in_async_checkpointings_terms():
    from meshpact.live.trials.analysis import TrialResult
    from meshpact.live.trials.outcome import PeerCopyReport, RankOutcome
    from meshpact.live.trials.trialconfig import TrialConfig

    cfg = TrialConfig(ranks=2, steps=4, faults=1, fault_kind="kill", baselines=False, checkpoint_every=2)
    ref = [RankOutcome(r, step_s=(0.2, 0.2, 0.2, 0.2)) for r in range(2)]
    faulted = [
        RankOutcome(
            0,
            step_s=(0.25,) * 4,
            storage_bytes_read=0,
            peer=PeerCopyReport(commits=5, snapshot_s=0.05, ship_s=0.5, bytes_sent=5000, host_bytes_peak=3000),
        ),
        RankOutcome(
            1,
            incarnation=1,
            step_s=(0.25,) * 3,
            storage_bytes_read=0,
            peer=PeerCopyReport(commits=4, snapshot_s=0.04, ship_s=0.4, bytes_sent=4000, host_bytes_peak=4000),
        ),
    ]
    result = TrialResult(cfg, (), ref, faulted, None, {}, True, [], 1, "r.jsonl")
    over = result.peer_copy_overhead()
    assert over["step_latency"] == pytest.approx(0.25)
    assert over["host_bytes_per_rank"] == 4000  # the most any rank held
    assert over["network_bytes_per_step"] == 2000  # 1000 bytes per commit from each of the two ranks
    assert over["network_bytes_per_hour"] == pytest.approx(2000 * 3600 / 0.25)
    assert over["snapshot_ms_per_commit"] == pytest.approx(10.0)
    assert result.summary()["storage_bytes_read"] == 0 and result.summary()["final_world_size"] == 2
    none = TrialResult(cfg, (), ref, [RankOutcome(0), RankOutcome(1)], None, {}, True, [], 0, "r.jsonl")
    assert none.peer_copy_overhead() is None


def test_a_paused_ship_sends_nothing_more_until_resumed_and_a_forgotten_pause_ends_by_itself(server):
    """A recovery pauses the copy in flight (the cores are the recovery's): the holder gets none
    of its body until the copier resumes; a pause nobody lifts ends after ``timeout_s / 2``."""
    other = PeerServer("127.0.0.1", key=KEY)
    try:
        copier = _copier(0, [other, server], timeout_s=2.0)
        big = {f"param/{i}": torch.full((1 << 20,), float(i)) for i in range(3)}  # 12 MB: three pieces
        copier.pause()
        copier.commit(1, big)
        assert not copier.drain(0.3) and copier.paused and server.holds() == ()
        copier.resume()
        assert copier.drain(10) and server.holds() == ((0, 1),)
        got, _ = fetch(_addr(server), 0, 1, 5.0, key=KEY)
        assert all(torch.equal(got[k], big[k]) for k in big)
        t0 = time.monotonic()
        copier.pause()
        copier.commit(2, big)
        assert copier.drain(10) and time.monotonic() - t0 >= 0.9 and not copier.paused
        assert server.holds() == ((0, 1), (0, 2))
        copier.close()
    finally:
        other.close()
