"""The node drills' launchers: one node of a two-node c10d rendezvous (``meshpact launch`` or plain
``torchrun``), run in its host's network namespace (:class:`~meshpact.live.netns.TwoHosts` or
:class:`~meshpact.live.netns.Hosts`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol, Sequence

from meshpact.live.trials.launchdrill import Job

PORT = 29400  # the rendezvous store's port on the endpoint's host


class NodeHosts(Protocol):
    tag: str

    @property
    def addr(self) -> Sequence[str]: ...

    def prefix(self, host: int) -> list[str]: ...


def rdzv_flags(
    hosts: NodeHosts, host: int, rdzv_id: str, endpoint: int = 0, nproc: int = 2, says_host: bool = True
) -> list[str]:
    """The launcher flags of ``host``: two nodes of ``nproc`` workers meeting at ``endpoint``'s address in
    the rendezvous ``rdzv_id`` + the hosts' tag (``says_host``: each node says whether it is the endpoint's)."""
    flags = ["--nnodes", "2", "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d"]
    flags += ["--rdzv-endpoint", f"{hosts.addr[endpoint]}:{PORT}", "--rdzv-id", rdzv_id + hosts.tag]
    if says_host:
        flags += ["--rdzv-conf", f"is_host={int(host == endpoint)}"]
    return [*flags, "--local-addr", hosts.addr[host]]


def node_job(
    hosts: NodeHosts, host: int, flags: list[str], out: Path, steps: int, env: dict[str, str], name: str, **kw: Any
) -> Job:
    """``flags``' launcher in ``host``'s namespace, its ranks taking 50 ms a step, writing into ``out``."""
    return Job(flags, out, steps, step_s=0.05, prefix=hosts.prefix(host), env=env, name=name, **kw)
