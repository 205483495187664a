"""Two hosts as network namespaces: reachable only over their shaped veth, counted by the kernel, removed."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from meshpact.live.netns import LinkShape, NetnsError, TwoHosts, netem_unavailable, netns_unavailable

needs_netns = pytest.mark.skipif(netns_unavailable() is not None, reason=str(netns_unavailable()))

_SERVER = r"""
import socket, sys
s = socket.socket(); s.bind((sys.argv[1], 5001)); s.listen(1)
print("ready", flush=True)
c, _ = s.accept(); n = 0
while True:
    b = c.recv(1 << 20)
    if not b:
        break
    n += len(b)
print(n, flush=True)
"""
_CLIENT = r"""
import socket, sys
c = socket.create_connection((sys.argv[1], 5001)); c.sendall(b"x" * int(sys.argv[2])); c.close()
"""


def _transfer(hosts: TwoHosts, nbytes: int) -> tuple[int, float]:
    """Send ``nbytes`` from host 2 to host 1 over TCP; (bytes received, seconds)."""
    server = subprocess.Popen(
        [*hosts.prefix(0), sys.executable, "-c", _SERVER, hosts.addr[0]], stdout=subprocess.PIPE, text=True
    )
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "ready"
        t0 = time.perf_counter()
        subprocess.run(
            [*hosts.prefix(1), sys.executable, "-c", _CLIENT, hosts.addr[0], str(nbytes)], check=True, timeout=60
        )
        got = int(server.stdout.readline())
        return got, time.perf_counter() - t0
    finally:
        server.kill()
        server.wait()


def test_a_bad_link_shape_is_refused_with_what_was_expected():
    with pytest.raises(NetnsError, match="positive rate"):
        LinkShape(gbit_per_s=0)
    with pytest.raises(NetnsError, match="delay >= 0"):
        LinkShape(delay_ms=-1)
    with pytest.raises(NetnsError, match="at most 10 letters"):
        TwoHosts(tag="a-b")


@pytest.mark.netns
@needs_netns
def test_traffic_between_the_hosts_crosses_the_veth_and_the_kernel_counts_it():
    with TwoHosts(LinkShape(1.0)) as hosts:
        assert "tbf" in hosts.qdisc(0) and "rate 1Gbit" in hosts.qdisc(1)
        before = hosts.settled_counters()
        got, _ = _transfer(hosts, 2_000_000)
        after = hosts.settled_counters()  # the connection's last acknowledgements counted on both ends
        rx = after[0] - before[0]
        tx = after[1] - before[1]
    assert got == 2_000_000
    assert 2_000_000 <= rx.rx_bytes < 2_200_000  # payload plus TCP/IP/Ethernet headers
    assert tx.tx_bytes == rx.rx_bytes  # a veth pair: what one end sends the other receives
    assert not hosts.exists()  # leaving the block deleted both namespaces and the link


@pytest.mark.netns
@needs_netns
def test_an_idle_link_carries_nothing_the_kernel_sends_by_itself():
    # with IPv6 on, router solicitations and multicast reports cross at random moments in the
    # first seconds after the link comes up and land in any count taken then
    with TwoHosts() as hosts:
        before = hosts.counters(0), hosts.counters(1)
        time.sleep(1.5)
        assert (hosts.counters(0), hosts.counters(1)) == before
        assert before[0].tx_packets == before[1].tx_packets == 0


@pytest.mark.netns
@needs_netns
def test_a_name_another_run_holds_is_drawn_again_or_refused_when_fixed(monkeypatch):
    netns = sys.modules[TwoHosts.__module__]

    with TwoHosts() as held:
        with pytest.raises(NetnsError, match="exists"):
            with TwoHosts(tag=held.tag):
                pass
        assert held.exists()  # the refused pair deleted nothing it had not made
        drawn = iter([held.tag, "77777abcde"])
        monkeypatch.setattr(netns, "_fresh_tag", lambda: next(drawn))
        with TwoHosts() as other:
            assert other.tag == "77777abcde" and set(other.ns).isdisjoint(held.ns)
            assert other.addr != held.addr or other.iface != held.iface
            assert held.exists() and other.exists()
        assert held.exists()  # the retry deleted only what it made itself


@pytest.mark.netns
@needs_netns
def test_the_rate_limit_holds_a_transfer_to_the_configured_rate():
    nbytes, gbit = 6_000_000, 0.1
    with TwoHosts(LinkShape(gbit)) as hosts:
        _, seconds = _transfer(hosts, nbytes)
    # the bucket lets its burst through at once; the rest cannot move faster than the rate
    burst = int(LinkShape(gbit).tbf_args()[4])
    assert seconds >= (nbytes - burst) * 8 / (gbit * 1e9) * 0.95


@pytest.mark.netns
@needs_netns
def test_parallel_pairs_get_their_own_names_and_both_are_torn_down():
    with TwoHosts() as a, TwoHosts() as b:
        assert set(a.ns).isdisjoint(b.ns) and set(a.iface).isdisjoint(b.iface)
        assert a.exists() and b.exists()
    assert not a.exists() and not b.exists()


@pytest.mark.netns
@needs_netns
def test_a_delay_needs_netem_and_says_so_where_the_kernel_lacks_it():
    why = netem_unavailable()
    if why:
        with pytest.raises(NetnsError, match="netem"):
            with TwoHosts(LinkShape(1.0, delay_ms=5)):
                pass
        return
    with TwoHosts(LinkShape(1.0, delay_ms=20)) as hosts:
        _, seconds = _transfer(hosts, 1000)
    assert seconds >= 0.04  # the connection's handshake alone crosses the link twice


@pytest.mark.netns
@needs_netns
def test_a_terminated_owner_still_tears_its_hosts_down():
    code = (
        "import sys, time; from meshpact.live.netns import TwoHosts\n"
        "h = TwoHosts().__enter__(); print(h.ns[0], flush=True); time.sleep(60)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    ns = proc.stdout.readline().strip()
    assert ns in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    proc.terminate()
    proc.wait(timeout=30)
    assert ns not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
