"""The data path's sockets, told by construction: those gloo opened while the job's groups were
built; a fault severs them and nothing else, and waits for a message under way to end first."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any

import pytest

from meshpact.live.recovery import communicator as comm
from meshpact.live.recovery.session import DataPath


@pytest.fixture
def pairs() -> Iterator[list[socket.socket]]:
    """Connected loopback TCP pairs made on request (both ends in this process), closed after."""
    made: list[socket.socket] = []

    def connect() -> tuple[socket.socket, socket.socket]:
        with socket.create_server(("127.0.0.1", 0)) as server:
            client = socket.create_connection(server.getsockname())
            accepted, _ = server.accept()
        made.extend((client, accepted))
        return client, accepted

    yield connect  # type: ignore[misc]  # the fixture yields a function
    for s in made:
        s.close()


def _fds(*socks: socket.socket) -> set[int]:
    return {s.fileno() for s in socks}


def _gloo_like(*socks: socket.socket) -> None:
    for s in socks:  # gloo's option on every pair it connects or accepts
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def test_the_data_path_is_the_sockets_its_groups_opened_as_they_were_built_never_the_users(pairs):
    path = DataPath(comm.socket_fds(), ())  # what was open before: as at a session's start
    users_before = pairs()
    path.look({"meshpact_data_g0"})  # the start's look: no group socket yet
    before = comm.socket_fds()
    built = pairs()
    _gloo_like(*built)
    path.record(["meshpact_data_g1"], comm.opened_since(before))
    users_after = pairs()
    _gloo_like(users_after[0])  # the user's own, opened after the build: not the data path's whatever its options
    assert set(path.sockets({}, {"meshpact_data_g1"})) == _fds(*built)
    # the standby's sockets are kept out; a group no longer live is not the data path
    keep = {fd: ino for fd, ino in comm.socket_fds().items() if fd == built[0].fileno()}
    assert set(path.sockets(keep, {"meshpact_data_g1"})) == {built[1].fileno()}
    assert set(path.sockets({}, {"meshpact_data_g0"})) == set()
    assert not _fds(*users_before, *users_after) & set(path.sockets({}, {"meshpact_data_g0", "meshpact_data_g1"}))


def test_a_group_the_user_made_is_told_from_the_gloo_sockets_opened_since_the_last_look(pairs):
    path = DataPath(comm.socket_fds(), ())
    path.look({"meshpact_data_g0"})
    echo = pairs()  # the user's connection, opened after the look
    theirs = pairs()  # and the user's new_group's pair, with gloo's options
    _gloo_like(*theirs)
    assert set(path.sockets({}, {"meshpact_data_g0", "metrics"})) == _fds(*theirs)
    path.look({"meshpact_data_g0", "metrics"})
    later = pairs()
    _gloo_like(*later)  # opened after the group was told: not that group's
    assert set(path.sockets({}, {"meshpact_data_g0", "metrics"})) == _fds(*theirs)
    assert not _fds(*echo) & set(path.sockets({}, {"meshpact_data_g0", "metrics"}))


def test_a_port_protected_is_never_severed(pairs):
    path = DataPath(comm.socket_fds(), ())
    before = comm.socket_fds()
    client, accepted = pairs()
    _gloo_like(client, accepted)
    path.protect_ports([accepted.getsockname()[1]])  # a peer server's port, or a store's
    path.record(["g"], comm.opened_since(before))
    assert set(path.sockets({}, {"g"})) == set()


def test_severing_a_real_gloo_groups_sockets_fails_its_collective_and_leaves_the_users_connections_working():
    """Two ranks of one gloo group in this process, built while a thread of the user's opens a
    connection to its own echo server: the group's sockets are its two pair ends, exactly; severed,
    the group's all-reduce fails and the user's connections, opened before and during, still echo."""
    import threading
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    server = socket.create_server(("127.0.0.1", 0))

    def echo() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            threading.Thread(
                target=lambda c=conn: [c.sendall(b) for b in iter(lambda: c.recv(64), b"")], daemon=True
            ).start()

    threading.Thread(target=echo, daemon=True).start()
    user_before = socket.create_connection(server.getsockname())
    path = DataPath(comm.socket_fds(), ())
    store = dist.HashStore()
    groups: dict[int, Any] = {}  # gloo backends, used as groups
    user_during: list[socket.socket] = []
    before = comm.socket_fds()

    def build(rank: int) -> None:
        if rank == 0:
            user_during.append(socket.create_connection(server.getsockname()))
        groups[rank] = dist.ProcessGroupGloo(dist.PrefixStore("g/", store), rank, 2, timedelta(seconds=5))

    threads = [threading.Thread(target=build, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    path.record(["g"], comm.opened_since(before))
    got = path.sockets({}, {"g"})
    assert len(got) == 2  # one pair, both its ends in this process
    users = [user_before, *user_during]
    assert not {s.fileno() for s in users} & set(got)
    assert comm.sever(got).sockets == 2
    failed: list[BaseException] = []

    def reduce(rank: int) -> None:
        try:
            groups[rank].allreduce([torch.ones(1)]).wait()
        except RuntimeError as exc:
            failed.append(exc)

    threads = [threading.Thread(target=reduce, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(failed) == 2
    for s in users:
        s.settimeout(5)
        s.sendall(b"ping")
        assert s.recv(4) == b"ping"
        s.close()
    server.close()


def test_a_sever_says_how_its_wait_for_a_message_under_way_ended(pairs):
    """Idle sockets: no message under way, no wait. A large message the peer never reads: the wait
    gives up once the queue has not moved for FLUSH_STALL_S and says what was left queued (what a
    recovery's record names when a sever took a tenth of a second)."""
    idle, _ = pairs()
    quiet = comm._flush([idle])
    assert quiet.flush_end == "none" and quiet.unsent == quiet.unread == 0
    writer, reader = pairs()
    writer.setblocking(False)
    sent = 0
    try:
        while True:  # fill both ends' buffers: the reader never reads
            sent += writer.send(b"\0" * 65536)
    except BlockingIOError:
        pass
    assert sent > comm.FLUSH_LARGE_BYTES
    stuck = comm._flush([writer])
    assert stuck.flush_end == "stalled" and stuck.unsent > comm.FLUSH_LARGE_BYTES and stuck.unread == 0
    assert stuck.flush_s >= comm.FLUSH_STALL_S
    unread = comm._flush([reader])  # the other end: bytes received and never read
    assert unread.flush_end == "stalled" and unread.unread > comm.FLUSH_LARGE_BYTES


def test_a_sever_waits_through_a_writers_pauses_and_says_the_longest(pairs):
    """A large message written in pieces with a pause between each (a writer the machine leaves
    unscheduled): the flush on the receiving end, watching while a reader drains it, waits through
    every pause shorter than FLUSH_SETTLE_S, ends only after the last piece, and says the longest
    quiet spell it saw (what a bench reads to tell whether the settle outlasts this machine's)."""
    import threading
    import time

    writer, reader = pairs()
    piece, pieces, pause = b"\1" * (8 * comm.FLUSH_LARGE_BYTES), 6, 0.004
    last_sent, first_sent = [], threading.Event()

    def write() -> None:
        for i in range(pieces):
            writer.sendall(piece)
            first_sent.set()  # the sever comes while the message moves
            if i < pieces - 1:
                time.sleep(pause)
        last_sent.append(time.monotonic())

    def read() -> None:  # slow through the first piece (the sever's first look finds it queued), then at once
        got = 0
        while got < pieces * len(piece):
            got += len(reader.recv(comm.FLUSH_LARGE_BYTES // 4 if got < len(piece) else 1 << 20))
            if got < len(piece):
                time.sleep(0.0002)

    threads = [threading.Thread(target=write), threading.Thread(target=read)]
    for t in threads:
        t.start()
    assert first_sent.wait(10)
    ended = comm._flush([reader])
    done = time.monotonic()
    for t in threads:
        t.join(10)
    assert ended.flush_end == "settled", ended
    assert last_sent and done > last_sent[0]  # it did not judge the message over in a pause
    assert ended.gap_s < ended.flush_s


class _Sock:
    """A socket for :func:`comm._flush` whose traffic a test makes up: it keeps the options asked of it."""

    def __init__(self, unread: int = 0) -> None:
        self.asked: list[tuple[int, int, int]] = []
        self.unread = unread  # bytes received and not read (what ``comm._queued`` says of it)

    def setsockopt(self, level: int, name: int, value: int) -> None:
        self.asked.append((level, name, value))


class _Clock:
    """A clock for :func:`comm._flush` that moves only when it sleeps: each sleep lasts the next of
    ``late`` (a look that wakes late) or the asked time."""

    def __init__(self, late: dict[int, float] | None = None) -> None:
        self.t = 0.0
        self.sleeps = 0
        self.late = late or {}

    def monotonic(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.sleeps += 1
        self.t += self.late.get(self.sleeps, s)


def _fake_flush(monkeypatch, clock: _Clock, moving: list[tuple[float, float]]) -> None:
    """Have :func:`comm._flush` run on ``clock`` over :class:`_Sock` sockets whose bytes move during
    the ``moving`` spans (:func:`_stream`)."""
    monkeypatch.setattr(comm, "time", clock)
    monkeypatch.setattr(comm, "_traffic", _stream(clock, moving))
    monkeypatch.setattr(comm, "_queued", lambda sock: sock.unread)


def _stream(clock: _Clock, moving: list[tuple[float, float]], rate: float = 1e9):
    """``_traffic`` of one socket whose bytes move at ``rate`` during the ``moving`` spans, its queues empty."""

    def traffic(_sock):
        moved = sum(max(0.0, min(clock.t, b) - a) for a, b in moving)
        return 0, 0, int(moved * rate)

    return traffic


def test_a_flushs_own_late_look_is_not_counted_as_a_pause_of_the_message(monkeypatch):
    """A stream that never stops, watched by a flush whose one look wakes 40 ms late: no pause of the
    message is recorded (every look saw it move), the late look is (``wake_s``), and the flush
    settles FLUSH_SETTLE_S after the stream ends."""
    clock = _Clock(late={10: 0.040})
    _fake_flush(monkeypatch, clock, [(0.0, 0.1)])
    ended = comm._flush([_Sock()])
    assert ended.flush_end == "settled" and ended.gap_s == 0.0
    assert ended.wake_s == pytest.approx(0.040)
    assert 0.1 + comm.FLUSH_SETTLE_S <= ended.flush_s < 0.1 + comm.FLUSH_SETTLE_S + 0.003


def test_a_real_pause_of_the_message_is_recorded_at_no_more_than_its_length(monkeypatch):
    clock = _Clock()
    _fake_flush(monkeypatch, clock, [(0.0, 0.010), (0.030, 0.040)])
    ended = comm._flush([_Sock()])
    assert ended.flush_end == "settled"
    assert 0.018 <= ended.gap_s <= 0.020 + 1e-9 and ended.wake_s == pytest.approx(comm.FLUSH_LOOK_S)


def test_a_flush_has_its_read_sockets_acknowledge_at_once_at_every_look(monkeypatch):
    """A peer whose send waits on this end's acknowledgement would pause its message for the
    kernel's delayed-ACK timer (40 ms at least), and the flush would wait the pause out: every look
    asks for quick acknowledgements again, on every socket it watches whose bytes were all read.
    One with bytes unread is never asked: its acknowledgement would offer the peer the narrow
    window they leave, and the sever that follows shuts its reading down, after which no reading
    widens the window again (test_drain_window)."""
    clock = _Clock()
    _fake_flush(monkeypatch, clock, [(0.0, 0.010)])
    socks = [_Sock(), _Sock(), _Sock(unread=4096)]
    ended = comm._flush(socks)
    assert ended.flush_end == "settled"
    for s in socks[:2]:
        assert set(s.asked) == {(socket.IPPROTO_TCP, socket.TCP_QUICKACK, 1)} and len(s.asked) == clock.sleeps
    assert socks[2].asked == []


def test_a_drain_reads_a_send_resuming_after_a_pause_within_about_the_pause_again():
    """A peer whose large send pauses (unscheduled a few milliseconds) and resumes into a full
    buffer waits for the drain's next look: after bytes moved, the looks come every
    ``DRAIN_MOVING_S`` and then twice as far apart each time, so a pause of ``p`` costs at most
    about ``p`` more, never the 40 ms a jump back to the idle cadence cost. With nothing
    moving the drain backs off to ``DRAIN_IDLE_MOST_S`` and never past it."""
    from meshpact.live.recovery.communicator import DRAIN_FIRST_S, DRAIN_IDLE_MOST_S, DRAIN_MOVING_S, drain_delay

    for pause in (0.0007, 0.002, 0.003, 0.006, 0.011, 0.025):
        t, delay = 0.0, drain_delay(DRAIN_FIRST_S, True)  # the look at t=0 read bytes; none until `pause`
        while t < pause:
            t += delay
            delay = drain_delay(delay, False)
        assert t - pause <= pause + DRAIN_MOVING_S, (pause, t)
    delay, waits = DRAIN_FIRST_S, []
    for _ in range(8):  # held, nothing ever arrives
        delay = drain_delay(delay, False)
        waits.append(delay)
    assert waits[0] > DRAIN_FIRST_S and max(waits) == DRAIN_IDLE_MOST_S


def test_a_held_socket_is_drained_and_asks_for_quick_acknowledgements_once_its_queue_is_empty(pairs, monkeypatch):
    """A severed socket held for the drain: what the peer still sends is read and dropped once gloo
    let go of it. A look finding a held socket's queue empty, whoever reads it, has it send the
    acknowledgement the kernel holds back (a peer's send waiting on a delayed acknowledgement
    paused 40 ms); one with bytes queued (gloo still holds it and has not read them) is never
    asked: its acknowledgement would offer the peer a narrowed window (test_drain_window)."""
    import os
    import time

    asked: list[int] = []
    monkeypatch.setattr(comm, "_quick_ack", lambda sock: asked.append(sock.fileno()))
    held = comm.SeveredSockets()
    sender, receiver = pairs()
    other_sender, other_receiver = pairs()
    sender.sendall(b"x" * 200_000)
    other_sender.sendall(b"z" * 1000)  # never read: gloo still holds that socket
    gone = os.dup(receiver.fileno())  # gloo's descriptor, closed: gloo let go of the socket
    inode = f"socket:[{os.fstat(gone).st_ino}]"
    os.close(gone)
    receiver.shutdown(socket.SHUT_RD)
    other_receiver.shutdown(socket.SHUT_RD)
    held.hold(receiver, gone, inode)
    held.hold(other_receiver, other_receiver.fileno(), f"socket:[{os.fstat(other_receiver.fileno()).st_ino}]")
    deadline = time.monotonic() + 5.0
    while comm._queued(receiver) and time.monotonic() < deadline:
        time.sleep(0.005)
    assert comm._queued(receiver) == 0  # drained
    while asked.count(receiver.fileno()) < 3 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert asked.count(receiver.fileno()) >= 3  # asked at the looks after it was drained
    assert other_receiver.fileno() not in asked and comm._queued(other_receiver) == 1000
    for _ in range(20):  # released while the drain looks (every rank left the generation): it drains the next
        held.release()
        time.sleep(0.0005)
    sender, receiver = pairs()
    sender.sendall(b"y" * 100_000)
    receiver.shutdown(socket.SHUT_RD)
    gone = os.dup(receiver.fileno())
    inode = f"socket:[{os.fstat(gone).st_ino}]"
    os.close(gone)
    held.hold(receiver, gone, inode)
    while comm._queued(receiver) and time.monotonic() < deadline + 5.0:
        time.sleep(0.005)
    assert comm._queued(receiver) == 0
    held.release()


def test_a_socket_gloo_lets_go_of_only_after_the_drains_first_looks_is_drained_from_then_on(pairs):
    """The drain asks gloo's hold of a socket only until gloo let go of it: one gloo still holds
    through several looks is left unread, and once gloo closes its descriptor (here while the
    peer keeps sending, and with that descriptor number taken again by another socket at once,
    as a new group's connection may take it) the drain reads it to the end."""
    import os
    import time

    held = comm.SeveredSockets()
    sender, receiver = pairs()
    sender.sendall(b"x" * 50_000)
    receiver.shutdown(socket.SHUT_RD)
    glooed = os.dup(receiver.fileno())  # gloo's descriptor, still open
    inode = f"socket:[{os.fstat(glooed).st_ino}]"
    held.hold(receiver, glooed, inode)
    time.sleep(0.1)  # several looks (2 ms, then doubling to 20 ms) while gloo holds it
    assert comm._queued(receiver) == 50_000  # gloo's to read: untouched
    stranger, _ = pairs()  # another connection, given gloo's number once gloo closes it
    os.close(glooed)
    os.dup2(stranger.fileno(), glooed)  # the number now names another socket
    try:
        sender.settimeout(5.0)  # (a drain that never read would fail it here, not hang)
        sender.sendall(b"y" * 150_000)  # the peer still sends
        deadline = time.monotonic() + 5.0
        while comm._queued(receiver) and time.monotonic() < deadline:
            time.sleep(0.005)
        assert comm._queued(receiver) == 0  # let go: drained, the later bytes too
    finally:
        os.close(glooed)
        held.release()


def test_a_socket_held_while_the_drain_waits_long_is_looked_at_after_the_first_delay(pairs):
    """The drain idles down to a look every ``DRAIN_IDLE_MOST_S``; a socket severed meanwhile (the next recovery)
    gets its first look ``DRAIN_FIRST_S`` after it is held, not at the idle look's time. A released
    socket is closed by the drain between its looks (closed while a look reads it, its
    descriptor could be reused by a new group's socket, whose bytes the drain would drop)."""
    import threading
    import time

    held = comm.SeveredSockets()
    held._thread = threading.current_thread()  # this test plays the drain thread: hold() starts none
    first, _ = pairs()
    second, _ = pairs()
    held.hold(first, -1, "")
    assert held._wait(0.0) == ([(first, -1, "")], True)
    got: list[object] = []
    waiter = threading.Thread(target=lambda: got.append((held._wait(30.0), time.monotonic())))
    waiter.start()
    time.sleep(0.05)
    t_held = time.monotonic()
    held.hold(second, -1, "")
    waiter.join(10.0)
    (((looked_at, fresh), t_look),) = got
    assert [s for s, _, _ in looked_at] == [first, second] and fresh and t_look - t_held < 5.0  # not the 30 s asked
    held.release()
    assert first.fileno() != -1  # still open: the drain closes it, between two looks
    again, _ = pairs()
    held.hold(again, -1, "")
    assert held._wait(0.0) == ([(again, -1, "")], True)
    assert first.fileno() == -1 and second.fileno() == -1 and again.fileno() != -1
    idle = comm.SeveredSockets()  # no drain thread ever started: closed at once
    third, _ = pairs()
    idle._held.append((third, -1, ""))
    idle.release()
    assert third.fileno() == -1


def test_quick_acknowledgements_are_asked_only_of_sockets_whose_bytes_were_all_read(pairs):
    """On real sockets: one with bytes unread is not asked (its acknowledgement would offer a window
    narrowed by them, and a severed socket never widens it again when read); one read to the end
    is, and so is it again once its bytes are read."""
    import os
    import time

    class Spy(socket.socket):
        def __init__(self, fd: int) -> None:
            super().__init__(fileno=fd)
            self.asked = 0

        def setsockopt(self, *args) -> None:
            self.asked += 1
            super().setsockopt(*args)

    sender, receiver = pairs()
    other_sender, other_receiver = pairs()
    sender.sendall(b"x" * 10_000)
    spies = [Spy(os.dup(receiver.fileno())), Spy(os.dup(other_receiver.fileno()))]
    try:
        deadline = time.monotonic() + 5.0
        while comm._queued(spies[0]) < 10_000 and time.monotonic() < deadline:
            time.sleep(0.001)
        comm._quick_acks(spies)
        assert [s.asked for s in spies] == [0, 1]
        while comm._queued(spies[0]):
            spies[0].recv(65536)
        comm._quick_acks(spies)
        assert [s.asked for s in spies] == [1, 2]
    finally:
        for s in spies:
            s.close()


def test_a_users_nodelay_connection_opened_before_they_make_a_group_is_not_that_groups(pairs, monkeypatch):
    """An HTTP client (urllib3 sets TCP_NODELAY on every connection it opens), a gRPC or Redis
    client: opened after the session started and before the job's code made a group of its own,
    it is the user's, not the group's; the group's sockets are those its build opened."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    from meshpact.live.recovery.usergroups import UserGroups, route_group_creation

    class _Default:
        def size(self) -> int:
            return 1

        def rank(self) -> int:
            return 0

    monkeypatch.setattr(c10d, "_get_default_group", lambda: _Default())
    monkeypatch.setattr(c10d, "_new_group_with_tag", c10d._new_group_with_tag)  # the routing undone after
    spec = comm.GroupSpec("gloo", "cpu", 0, 1, 5.0, connect_timeout_s=5.0, run_id="nodelay")
    store = dist.HashStore()
    path = DataPath(comm.socket_fds(), ())
    path.look({"meshpact_data_g0"})  # the session's start
    client = pairs()
    _gloo_like(client[0])  # urllib3's default socket options
    control = type("Control", (), {"set": lambda self, k, v: None, "get": lambda self, k, d=None: d})()
    groups = UserGroups(lambda: (spec, store, control, 0), path.record)
    routed = route_group_creation(groups, "gloo")
    made = c10d._new_group_with_tag([0])  # the user's metrics reducer: dist.new_group([0]) reaches this
    # and one torch builds itself (local synchronization is not matched): its build is recorded too
    routed.original = lambda *a, **kw: type("PG", (), {"group_name": "torchs_own"})()
    theirs = c10d._new_group_with_tag([0], use_local_synchronization=True)
    live = {"meshpact_data_g0", made.group_name, theirs.group_name}
    assert not _fds(*client) & set(path.sockets({}, live))
    path.look(live)
    assert not _fds(*client) & set(path.sockets({}, live))
