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
