"""A peer's large sends into a severed socket held for the drain never meet a closed window.

A severed socket is shut down for reading, and Linux then sends no window update when it is read:
once this end offered the peer a zero window, the peer's send waits for its zero-window probe
(200 ms, doubling) however fast the drain empties the buffer. The drain asked for quick
acknowledgements of every held socket at every look, bytes queued or not; each such
acknowledgement offered the peer what the unread bytes left of the window, and messages of 200 KB
and more stalled 200 ms to 2.8 s each. The kernel counts every zero window it offers
(``TCPToZeroWindowAdv``) and every probe it answers (``TCPWinProbe``) per network namespace, so the
trial runs in a namespace of its own, where nothing else moves.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from meshpact.live.netns import netns_unavailable

pytestmark = [pytest.mark.live, pytest.mark.netns,
              pytest.mark.skipif(netns_unavailable(shaped=False) is not None,
                                 reason=str(netns_unavailable(shaped=False)))]

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
    time.sleep((0.0, 0.0003, 0.001, 0.003)[i % 4])  # messages back to back, and after short pauses
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
def test_a_peers_large_sends_into_a_held_socket_never_meet_a_zero_window(size):
    done = subprocess.run(["unshare", "--net", sys.executable, "-c", _TRIAL, str(size), "40"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen == {"zero_windows": 0, "probes": 0, "left": 0}, seen
