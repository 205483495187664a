"""What every serving loop shares: the requests' tokens, the clients, the checked plans, the
step command and the link's probes.

The ``requests`` deployment (:mod:`.serving`), the model split (:mod:`.split`) and speculative
decoding (:mod:`.speculative`) are three loops over the same pieces; they live here so that
each loop imports them and :mod:`.serving`, the entry point, imports the loops, never the
other way round.
"""

from __future__ import annotations

import os
import random
import time
from collections import deque
from typing import Any, Mapping, Sequence

from meshpact.core.errors import MeshpactError
from meshpact.core.facts import Request

__all__ = [
    "prompt_for",
    "targets_for",
    "ClosedLoop",
    "CheckedPlans",
    "ResultPlans",
    "with_compiled",
    "slot_word",
    "EMPTY",
    "ACTIVE",
    "NEW",
    "mean_of",
    "handshake",
    "veth_counters",
]


# -- requests: prompts and targets both hosts derive from the request id ---------------------
def prompt_for(cfg: Mapping[str, Any], rid: int, vocab: int) -> list[int]:
    rng = random.Random(cfg["seed"] * 1_000_003 + rid)
    return [rng.randrange(vocab) for _ in range(cfg["prompt_tokens"])]


def targets_for(cfg: Mapping[str, Any], rid: int, vocab: int) -> list[int]:
    rng = random.Random(cfg["seed"] * 1_000_003 + rid + 500_000)
    return [rng.randrange(vocab) for _ in range(cfg["output_tokens"])]


# -- closed-loop clients ------------------------------------------------------------------------
class ClosedLoop:
    """``total`` requests from closed-loop clients: :meth:`start` issues one per client, and
    every :meth:`complete` records the request's latency and issues the next (while any is
    left). New requests wait in :attr:`pending` for whoever places them; request ids count
    from 0 in issue order. The caller serialises calls (one thread, or under its lock)."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.issued = self.completed = 0
        self.arrival: dict[int, float] = {}
        self.latencies: list[float] = []
        self.pending: deque[int] = deque()

    def start(self, clients: int) -> None:
        for _ in range(clients):
            self.issue()

    def issue(self) -> int | None:
        """The next request (appended to :attr:`pending`), or None when all were issued."""
        if self.issued >= self.total:
            return None
        rid = self.issued
        self.issued += 1
        self.arrival[rid] = time.perf_counter()
        self.pending.append(rid)
        return rid

    def complete(self, rid: int) -> None:
        self.latencies.append(time.perf_counter() - self.arrival[rid])
        self.completed += 1
        self.issue()

    @property
    def finished(self) -> bool:
        return self.completed >= self.total


# -- checked plans per row count ----------------------------------------------------------------
class CheckedPlans:
    """The lowered plan of :meth:`edge` for each row count, admitted by the checker once and
    cached: every loop's results, hidden states and verdicts go through one of these."""

    what = "result"  # named in the refusal

    def __init__(self) -> None:
        self._cache: dict[int, tuple[Any, Any]] = {}

    def edge(self, rows: int) -> Any:
        raise NotImplementedError

    def get(self, rows: int) -> tuple[Any, Any]:
        """(plan, contract) for ``rows`` rows."""
        if rows not in self._cache:
            from meshpact.core.checker import check
            from meshpact.core.contract import compile_contract
            from meshpact.core.lowerer import lower

            contract = compile_contract(self.edge(rows))
            plan = lower(contract)
            report = check(plan, contract)
            if not report.ok:
                raise MeshpactError(f"the lowered {self.what} plan fails the checker: {report.violations}")
            self._cache[rows] = (plan, contract)
        return self._cache[rows]


class ResultPlans(CheckedPlans):
    """A step's results: the producer tensor is host 2's ``logits [batch, vocab]``, read by host 1."""

    def __init__(self, request: str, vocab: int, mesh: Any) -> None:
        super().__init__()
        self.request, self.vocab, self.mesh = Request(request), vocab, mesh

    def edge(self, rows: int) -> Any:
        from meshpact.core.facts import Consumer, DType, Edge, ProducerTensor
        from meshpact.core.placement import Replicate

        prod, cons = self.mesh.domains[1], self.mesh.domains[0]
        return Edge(
            f"spillover_{self.request.value}_{rows}",
            self.mesh,
            ProducerTensor("logits", "lm_head", (rows, self.vocab), DType.BFLOAT16, prod.name, Replicate()),
            Consumer(
                "serving",
                cons.name,
                cons.ranks,
                self.request,
                owners=tuple(cons.ranks[0] for _ in range(rows)) if self.request is Request.OWNER_TOKEN else None,
            ),
            description="one step of a remote host's sequences, read by the serving host",
        )


def with_compiled(cfg: Mapping[str, Any], decoder: Any, parts: Sequence[tuple[Any, int]]) -> Any:
    """``decoder``, running its steps of ``parts`` ((part, tokens per step)) from AOTInductor
    packages when ``cfg["compile"]`` is ``aoti`` (compiled if a package is missing), eagerly
    otherwise. Every host builds its decoders through this, and :func:`precompile` through
    the same builders."""
    if cfg.get("compile", "eager") == "aoti":
        from .compiled import CompiledSteps

        CompiledSteps(cfg["package_dir"]).attach(decoder, parts)
    return decoder


# -- the step command and the link --------------------------------------------------------------
def slot_word(state: int, rid: int, token: int) -> list[int]:
    return [state, rid, token]


EMPTY, ACTIVE, NEW = 0, 1, 2


def mean_of(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def handshake(rank: int, rounds: int = 21) -> float:
    """Half the median round trip of one small message between the hosts (the link's α)."""
    import torch
    import torch.distributed as dist

    buf = torch.zeros(1, dtype=torch.long)
    rtts = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        if rank == 0:
            dist.send(buf, dst=1)
            dist.recv(buf, src=1)
        else:
            dist.recv(buf, src=0)
            dist.send(buf, dst=0)
        rtts.append(time.perf_counter() - t0)
    return sorted(rtts)[len(rtts) // 2] / 2


def veth_counters() -> tuple[int, int]:
    """(rx, tx) bytes of this host's veth end, from the kernel's statistics (0, 0 without one), as
    this process's network namespace sees them (``/proc/self/net/dev``: ``/sys`` shows the
    namespace of whoever mounted it, which a rank moved into its host's namespace need not share)."""
    dev = os.environ.get("MESHPACT_VETH")
    if not dev:
        return 0, 0
    with open("/proc/self/net/dev") as table:
        for line in table:
            name, sep, fields = line.partition(":")
            if sep and name.strip() == dev:
                counts = fields.split()
                return int(counts[0]), int(counts[8])
    raise FileNotFoundError(f"{dev}: no such interface in this network namespace (/proc/self/net/dev)")
