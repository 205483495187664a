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
