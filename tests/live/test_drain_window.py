"""A peer's large sends into a severed socket held for the drain meet no zero window.

A severed socket is shut down for reading, and Linux then sends no window update of its own when
it is read: only an acknowledgement already pending carries the wider window. Once this end offered
the peer a zero window, the peer's send waits for its zero-window probe (200 ms, doubling) however
fast the drain empties the buffer. A drain that asks for quick acknowledgements of every held
socket at every look, bytes queued or not, offers the peer what the unread bytes leave of the
window: in this trial, messages of 200 KB and more then stalled 200 ms to 2.8 s each. (A full
buffer still unread when the kernel's 40 ms delayed-ACK timer fires would offer a zero window too:
the drain, idle, looks every 20 ms, and this trial's pauses let it idle. With looks 50 ms apart
no zero window was seen here either, with messages up to 16 MB: the buffer had grown past them.)
The kernel counts the zero windows it offers (``TCPToZeroWindowAdv``) and the zero-window probes
it sends (``TCPWinProbe``) per network namespace, so the trial runs in a namespace of its own,
where nothing else moves.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from meshpact.live.netns import netns_unavailable

_UNAVAILABLE = (
    "no unshare (util-linux) to make a network namespace"
    if shutil.which("unshare") is None
    else netns_unavailable(shaped=False)
)
pytestmark = [
    pytest.mark.live,
    pytest.mark.netns,
    pytest.mark.slow,
    pytest.mark.skipif(_UNAVAILABLE is not None, reason=str(_UNAVAILABLE)),
]

_TRIAL = r"""
import json, os, socket, subprocess, sys, time
from meshpact.live.recovery import communicator as comm

subprocess.run(["ip", "link", "set", "lo", "up"], check=True)


def counters():
    rows = [line.split() for line in open("/proc/net/netstat") if line.startswith("TcpExt:")]
    return dict(zip(rows[0][1:], map(int, rows[1][1:])))


size, count = int(sys.argv[1]), int(sys.argv[2])
server = socket.create_server(("127.0.0.1", 0))
sender = socket.create_connection(server.getsockname())
receiver, _ = server.accept()
for s in (sender, receiver):
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # as gloo's pairs
before = counters()
receiver.shutdown(socket.SHUT_RD)  # severed, as comm.sever does with a drain
gone = os.dup(receiver.fileno())  # gloo's descriptor, closed: gloo let go of the socket
inode = f"socket:[{os.fstat(gone).st_ino}]"
os.close(gone)
held = comm.SeveredSockets()
held.hold(receiver, gone, inode)
for i in range(count):
    sender.sendall(b"x" * size)
    time.sleep((0.0, 0.0003, 0.003, 0.06)[i % 4])  # back to back, after short pauses, and after the drain idled
deadline = time.monotonic() + 30.0
while comm._queued(receiver) and time.monotonic() < deadline:
    time.sleep(0.001)
after = counters()
print(json.dumps({"zero_windows": after.get("TCPToZeroWindowAdv", 0) - before.get("TCPToZeroWindowAdv", 0),
                  "probes": after.get("TCPWinProbe", 0) - before.get("TCPWinProbe", 0),
                  "left": comm._queued(receiver)}))
held.release()
"""


@pytest.mark.parametrize("size", [200_000, 1_000_000])
def test_a_peers_large_sends_into_a_held_socket_meet_no_zero_window(size):
    done = subprocess.run(
        ["unshare", "--net", sys.executable, "-c", _TRIAL, str(size), "40"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen == {"zero_windows": 0, "probes": 0, "left": 0}, seen


_HOLDER = r"""
import json, os, socket, sys, time
from meshpact.live.recovery import communicator as comm


def counters():
    rows = [line.split() for line in open("/proc/net/netstat") if line.startswith("TcpExt:")]
    return dict(zip(rows[0][1:], map(int, rows[1][1:])))


server = socket.create_server((sys.argv[1], 5003))
print("ready", flush=True)
receiver, _ = server.accept()
receiver.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
before = counters()
receiver.shutdown(socket.SHUT_RD)
gone = os.dup(receiver.fileno())
inode = f"socket:[{os.fstat(gone).st_ino}]"
os.close(gone)
held = comm.SeveredSockets()
held.hold(receiver, gone, inode)
deadline = time.monotonic() + 60.0
while len(held) and time.monotonic() < deadline:  # the drain drops the socket once the peer's end was read
    time.sleep(0.005)
after = counters()
print(json.dumps({"zero_windows": after.get("TCPToZeroWindowAdv", 0) - before.get("TCPToZeroWindowAdv", 0),
                  "drained": not len(held)}), flush=True)
"""

_SENDER = r"""
import socket, sys, time
sender = socket.create_connection((sys.argv[1], 5003))
sender.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
for i in range(int(sys.argv[3])):
    sender.sendall(b"x" * int(sys.argv[2]))
    time.sleep((0.0, 0.0003, 0.003, 0.06)[i % 4])
sender.close()
"""


@pytest.mark.skipif(netns_unavailable(shaped=False) is not None, reason=str(netns_unavailable(shaped=False)))
def test_a_peer_on_another_host_sending_into_a_held_socket_meets_no_zero_window():
    """The same across a veth link between two network namespaces, as between two nodes: segments
    of an Ethernet MTU, not loopback's 64 KB, so many more acknowledgements each offer a window.
    The holder's namespace counts the zero windows it offered."""
    from meshpact.live.netns import TwoHosts

    with TwoHosts(link=None) as hosts:
        holder = subprocess.Popen(
            [*hosts.prefix(0), sys.executable, "-c", _HOLDER, hosts.addr[0]],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            assert holder.stdout is not None and holder.stdout.readline().strip() == "ready", holder.stderr
            subprocess.run(
                [*hosts.prefix(1), sys.executable, "-c", _SENDER, hosts.addr[0], "1000000", "40"],
                check=True,
                timeout=120,
            )
            out, err = holder.communicate(timeout=120)
        finally:
            holder.kill()
            holder.wait()
    assert holder.returncode == 0, err[-2000:]
    assert json.loads(out.strip().splitlines()[-1]) == {"zero_windows": 0, "drained": True}
