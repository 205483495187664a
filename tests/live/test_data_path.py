"""The data path's sockets, listed once per generation: a fault severs the remembered list while
the generation, its groups and the protected ports hold, and lists afresh when one changed."""

from __future__ import annotations

import socket
from collections.abc import Iterator

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

    yield connect  # type: ignore[misc]
    for s in made:
        s.close()


def _fds(*socks: socket.socket) -> set[int]:
    return {s.fileno() for s in socks}


def test_a_remembered_list_is_handed_back_while_its_key_holds_and_listed_afresh_when_it_changed(pairs):
    path = DataPath(comm.socket_fds(), ())  # what was open before: protected, as at a session's start
    first = pairs()
    path.remember(("g1", ("meshpact_data_g1",)))
    assert set(path.sockets({}, ("g1", ("meshpact_data_g1",)))) == _fds(*first)
    later = pairs()  # a socket opened since (a standby's, say) is not in the remembered list
    assert set(path.sockets({}, ("g1", ("meshpact_data_g1",)))) == _fds(*first)
    # a new generation or group, or no key at all: the descriptors are read again
    assert set(path.sockets({}, ("g2", ("meshpact_data_g2",)))) == _fds(*first, *later)
    assert set(path.sockets({}, None)) == _fds(*first, *later)
    # the standby's sockets are kept out of the remembered list too
    keep = {fd: ino for fd, ino in comm.socket_fds().items() if fd == first[0].fileno()}
    assert set(path.sockets(keep, ("g1", ("meshpact_data_g1",)))) == {first[1].fileno()}


def test_a_port_protected_after_the_list_was_remembered_is_never_severed_from_it(pairs):
    path = DataPath(comm.socket_fds(), ())
    client, accepted = pairs()
    path.remember("g1")
    path.protect_ports([accepted.getsockname()[1]])  # a peer server's port, learned late
    assert set(path.sockets({}, "g1")) == set()


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
    assert pause / 2 <= ended.gap_s < comm.FLUSH_SETTLE_S
