"""Serving spillover with batched hosts: every host decodes its sequences in lockstep.

The per-slot model of :mod:`meshpact.simulator.serving` lets each slot decode on its own,
so one slot's link transfer overlaps another's compute. A serving engine instead runs one
batched decode step for all the sequences it holds; this model does that, with the same
:class:`~meshpact.simulator.serving.ServingParams`, the same placement rule (a free local
slot, else a free remote slot, else wait for the first to free, local preferred), the same
α-β link resources and the same result plans (:func:`~meshpact.simulator.serving.result_plan`):

* a host's step starts with the prefills of the sequences that joined since the last
  step (``prefill_s`` each), then takes ``per_token_s`` and yields one token for every
  sequence it holds;
* the remote host sends *one* result message per step: the plan for ``batch`` rows;
* for ``full`` the consumer samples, so the remote host waits for the message and for the
  chosen ids to come back (one message of ``batch`` int64 ids) before its next step; for
  the others the ids are chosen at the source and the message streams back while the
  host decodes on;
* a request ends with its last token (local) or when its last result arrives (remote).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import simpy

from meshpact.core.facts import DType, LinkClass, LinkParams, Request
from meshpact.core.errors import ScenarioError
from meshpact.core.plan import Plan

from .serving import DuplexLink, ServingParams, ServingResult, result_plan

__all__ = ["simulate_batched"]


@dataclass
class _Seq:
    arrived: float
    left: int
    done: Any  # the event its client waits on


@dataclass
class _Host:
    name: str
    slots: int
    per_token_s: float
    prefill_s: float
    held: int = 0  # sequences placed here (joining or decoding)
    joining: list[_Seq] = field(default_factory=list)
    wake: Any = None


class _Lockstep:
    def __init__(self, p: ServingParams) -> None:
        self.p = p
        self.env = simpy.Environment()
        self.local = _Host("local", p.local_slots, p.local_per_token_s, p.local_prefill_s)
        self.remote = _Host("remote", p.remote_slots, p.remote_per_token_s, p.remote_prefill_s)
        self.link = DuplexLink(self.env, LinkParams(p.link_alpha_s, p.link_beta_s_per_byte))
        self.plans: dict[int, tuple[Plan, int]] = {}
        self.waiting: list[_Seq] = []
        self.issued = self.spilled = self.local_tokens = self.remote_tokens = self.passes = 0
        self.sent = self.received = self.feedback = self.startups = 0
        self.latencies: list[float] = []

    # -- placement ------------------------------------------------------------------------------
    def _place(self, seq: _Seq) -> None:
        for host in (self.local, self.remote):
            if host.held < host.slots:
                host.held += 1
                self.spilled += host is self.remote
                host.joining.append(seq)
                if host.wake is not None and not host.wake.triggered:
                    host.wake.succeed()
                return
        self.waiting.append(seq)

    def _finish(self, host: _Host, seq: _Seq) -> None:
        self.latencies.append(self.env.now - seq.arrived)
        host.held -= 1
        if self.waiting:
            self._place(self.waiting.pop(0))
        seq.done.succeed()

    # -- link -----------------------------------------------------------------------------------
    def _plan(self, rows: int) -> tuple[Plan, int]:
        if rows not in self.plans:
            plan = result_plan(self.p, rows)
            eth = sum(s.payload_bytes for s in plan.steps if s.startups and s.link is LinkClass.ETHERNET)
            self.plans[rows] = (plan, eth)
        return self.plans[rows]

    def _results(self, rows: int, ending: list[_Seq]):
        plan, nbytes = self._plan(rows)
        self.sent += nbytes
        self.startups += plan.startups
        yield from self.link.send(self.link.uplink, nbytes)
        self.received += nbytes
        for seq in ending:
            self._finish(self.remote, seq)

    # -- hosts ----------------------------------------------------------------------------------
    def _host(self, host: _Host):
        members: list[_Seq] = []
        full = self.p.request is Request.FULL
        while True:
            if not members and not host.joining:
                host.wake = self.env.event()
                yield host.wake
                host.wake = None
            joined, host.joining = host.joining, []
            if joined:
                yield self.env.timeout(host.prefill_s * len(joined))
                members += joined
            yield self.env.timeout(host.per_token_s)
            self.passes += 1
            rows = len(members)
            for seq in members:
                seq.left -= 1
            ending = [s for s in members if s.left == 0]
            members = [s for s in members if s.left > 0]
            if host is self.local:
                self.local_tokens += rows
                for seq in ending:
                    self._finish(host, seq)
                continue
            self.remote_tokens += rows
            sending = self.env.process(self._results(rows, ending))
            if full:
                yield sending
                nbytes = rows * DType.INT64.itemsize
                self.feedback += nbytes
                self.startups += 1
                yield from self.link.send(self.link.downlink, nbytes)

    def _client(self):
        while self.issued < self.p.requests:
            self.issued += 1
            seq = _Seq(self.env.now, self.p.output_tokens, self.env.event())
            self._place(seq)
            yield seq.done

    def run(self) -> ServingResult:
        p = self.p
        self.env.process(self._host(self.local))
        self.env.process(self._host(self.remote))
        clients = [self.env.process(self._client()) for _ in range(p.concurrency)]
        self.env.run(until=self.env.all_of(clients))
        end = self.env.now
        lat = np.asarray(self.latencies)
        mean_in_system = float(lat.sum() / end) if end else 0.0  # Little's law over the run
        return ServingResult(
            params=p, throughput_tok_s=(self.local_tokens + self.remote_tokens) / end if end else 0.0,
            latency_s={"p50": float(np.percentile(lat, 50)), "p99": float(np.percentile(lat, 99)),
                       "mean": float(lat.mean())},
            result_bytes=self.sent, bytes_received=self.received, feedback_bytes=self.feedback,
            startups=self.startups, requests=len(lat), spilled=self.spilled, local_tokens=self.local_tokens,
            remote_tokens=self.remote_tokens, target_passes=self.passes, makespan_s=end,
            link_busy_s=self.link.busy_s, mean_in_system=mean_in_system,
            arrival_rate_per_s=len(lat) / end if end else 0.0, latencies=tuple(float(x) for x in lat),
        )


def simulate_batched(p: ServingParams) -> ServingResult:
    """Simulate ``p`` closed-loop (``concurrency`` clients) with lockstep batched hosts."""
    if p.gamma is not None:
        raise ScenarioError("the batched model has no speculative decoding; use simulator.serving")
    if p.arrival_rate_per_s:
        raise ScenarioError("the batched model runs closed-loop clients only; set arrival_rate_per_s to None")
    return _Lockstep(p).run()
