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

:func:`simulate_split` is the other deployment, the model split by layers: every
sequence lives on one pipeline. Host 1 (``local_*``: its layers and the choice of the
next id) runs a step for all of them, the hidden states ``[batch, hidden]`` (bf16) cross
host 1 → host 2, host 2 (``remote_*``: the later layers, the LM head and the source
projection) runs its part, and the result plan for the request crosses back; the next
step needs the chosen ids, so nothing overlaps. A joining sequence's prefill runs on both
hosts with its prompt's hidden states crossing in between. With ``gamma`` and ``alpha``
set, the pipeline is speculative decoding instead: host 1 drafts ``γ`` tokens per
sequence (``local_per_token_s`` per round), host 2 scores ``γ + 1`` positions in one target
pass (``remote_per_token_s``), and either the logits of every position cross (``full``,
the plan for ``batch·(γ + 1)`` rows) or, verified at the source, an int64 pair per
sequence (accepted length, next token). Each draft token is accepted with probability
``α`` until the first rejection (seeded draws); a round yields the accepted drafts and one
token of the target's.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import simpy

from meshpact.core.facts import DType, LinkClass, LinkParams, Request
from meshpact.core.errors import ScenarioError
from meshpact.core.plan import Plan

from .serving import (
    DuplexLink,
    ServingParams,
    ServingResult,
    result_plan,
    serving_overrides,
    served,
    serving_params,
    simulate_serving,
)

__all__ = ["simulate_batched", "simulate_split", "simulate_deployment"]

DEFAULT_DRAFT_COST_RATIO = 0.1  # a draft token's time over a target pass, where the scenario gives none


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
        return served(self, float(np.sum(self.latencies)) / end if end else 0.0)  # Little's law over the run


def simulate_batched(p: ServingParams) -> ServingResult:
    """Simulate ``p`` closed-loop (``concurrency`` clients) with lockstep batched hosts."""
    if p.gamma is not None:
        raise ScenarioError("the batched model has no speculative decoding; use simulator.serving")
    if p.arrival_rate_per_s:
        raise ScenarioError("the batched model runs closed-loop clients only; set arrival_rate_per_s to None")
    return _Lockstep(p).run()


class _Pipeline(_Lockstep):
    """The model split by layers: one pipeline of two hosts holding every sequence."""

    def __init__(self, p: ServingParams, hidden_size: int, prompt_tokens: int) -> None:
        super().__init__(p)
        self.hidden_size, self.prompt_tokens = hidden_size, prompt_tokens
        self.boundary = 0  # hidden-state bytes host 1 -> host 2
        self.pending: list[_Seq] = []
        self.wake: Any = None
        self.rng = np.random.default_rng(p.seed)

    def _place(self, seq: _Seq) -> None:
        self.spilled += 1
        self.pending.append(seq)
        if self.wake is not None and not self.wake.triggered:
            self.wake.succeed()

    def _hidden(self, rows: int):
        nbytes = rows * self.hidden_size * DType.BFLOAT16.itemsize
        self.boundary += nbytes
        yield from self.link.send(self.link.downlink, nbytes)

    def _accepted(self) -> int:
        """Draft tokens one sequence-round accepts: each with probability α, until the first rejection."""
        k = 0
        while k < (self.p.gamma or 0) and self.rng.random() < (self.p.alpha or 0.0):
            k += 1
        return k

    def _pipeline(self):
        p = self.p
        members: list[_Seq] = []
        while True:
            if not members and not self.pending:
                self.wake = self.env.event()
                yield self.wake
                self.wake = None
            joined = self.pending[: max(0, p.concurrency - len(members))]
            self.pending = self.pending[len(joined) :]
            for _ in joined:
                yield self.env.timeout(p.local_prefill_s)
                if self.prompt_tokens > 1 and not p.gamma:  # the target has every layer: no hidden states cross
                    yield from self._hidden(self.prompt_tokens - 1)
                yield self.env.timeout(p.remote_prefill_s)
            members += joined
            rows = len(members)
            yield self.env.timeout(p.local_per_token_s)
            if p.gamma:  # the drafts travel in the round's command
                yield from self.link.send(self.link.downlink, rows * (p.gamma + 4) * DType.INT64.itemsize)
            else:
                yield from self._hidden(rows)
            yield self.env.timeout(p.remote_per_token_s)
            self.passes += 1
            messages: list[int] = []  # payload of each message host 2 sends back this round
            if p.gamma:
                # token and logprob: a verdict (accepted length, next token) verified at the source;
                # full, owner_token and logprob: the request's plan over the γ + 1 positions' logits
                if p.request in (Request.TOKEN, Request.LOGPROB):
                    messages.append(16 * rows)
                    self.startups += 1
                if p.request is not Request.TOKEN:
                    plan, nbytes = self._plan(rows * (p.gamma + 1))
                    messages.append(nbytes)
                    self.startups += plan.startups
                gained = [self._accepted() + 1 for _ in members]
            else:
                plan, nbytes = self._plan(rows)
                messages.append(nbytes)
                self.startups += plan.startups
                gained = [1] * rows
            for nbytes in messages:
                self.sent += nbytes
                yield from self.link.send(self.link.uplink, nbytes)
                self.received += nbytes
            for seq, g in zip(members, gained):
                got = min(g, seq.left)
                self.remote_tokens += got
                seq.left -= got
            ending = [s for s in members if s.left == 0]
            members = [s for s in members if s.left > 0]
            for seq in ending:
                self.latencies.append(self.env.now - seq.arrived)
                seq.done.succeed()

    def run(self) -> ServingResult:
        self.env.process(self._pipeline())
        clients = [self.env.process(self._client()) for _ in range(self.p.concurrency)]
        self.env.run(until=self.env.all_of(clients))
        end = self.env.now
        lat = np.asarray(self.latencies)
        return ServingResult(
            params=self.p,
            throughput_tok_s=self.remote_tokens / end if end else 0.0,
            latency_s={
                "p50": float(np.percentile(lat, 50)),
                "p99": float(np.percentile(lat, 99)),
                "mean": float(lat.mean()),
            },
            result_bytes=self.sent,
            bytes_received=self.received,
            feedback_bytes=self.boundary,
            startups=self.startups,
            requests=len(lat),
            spilled=self.spilled,
            local_tokens=0,
            remote_tokens=self.remote_tokens,
            target_passes=self.passes,
            makespan_s=end,
            link_busy_s=self.link.busy_s,
            mean_in_system=float(lat.sum() / end) if end else 0.0,
            arrival_rate_per_s=len(lat) / end if end else 0.0,
            latencies=tuple(float(x) for x in lat),
        )


def simulate_split(p: ServingParams, hidden_size: int, prompt_tokens: int) -> ServingResult:
    """Simulate ``p`` closed-loop with the model split by layers (see the module docstring):
    ``local_per_token_s`` is host 1's part of a step (its layers and the choice),
    ``remote_per_token_s`` host 2's (its layers, the head, the source projection); the
    hidden states of ``hidden_size`` cross per row. ``feedback_bytes`` of the result holds
    the hidden-state bytes (host 1 → host 2), ``result_bytes`` the results (host 2 → host 1)."""
    if p.gamma is not None and (p.gamma < 1 or p.alpha is None or not 0.0 <= p.alpha <= 1.0):
        raise ScenarioError(
            f"speculative pipeline: gamma {p.gamma}, alpha {p.alpha}: expected gamma >= 1 and "
            "an acceptance rate alpha in [0, 1]"
        )
    if p.arrival_rate_per_s:
        raise ScenarioError("the model-split pipeline runs closed-loop clients only; set arrival_rate_per_s to None")
    if hidden_size < 1 or prompt_tokens < 1:
        raise ScenarioError(f"hidden_size {hidden_size}, prompt_tokens {prompt_tokens}: expected positive integers")
    return _Pipeline(p, hidden_size, prompt_tokens).run()


def simulate_deployment(
    scenario: Any,
    deployment: str = "requests",
    *,
    gamma: int | None = None,
    acceptance: float | None = None,
    link_gbps: float | None = None,
    **flags: Any,
) -> ServingResult:
    """The scenario's serving section in either deployment (``flags`` as
    :func:`~meshpact.simulator.serving.simulate_serving`), optionally speculative.

    ``requests``: the per-slot spillover model (:func:`simulate_serving`), with the scenario's
    speculative section replaced by ``gamma``/``acceptance`` where given. ``model``: the
    split pipeline (:func:`simulate_split`); each host's ``per_token_s`` is taken as its part
    of a step, the hidden size is the catalog model's; speculative, host 1 drafts ``γ``
    tokens at ``draft_cost_ratio`` (the scenario's, else 0.1) of host 2's target pass each.
    """
    from meshpact.core.catalog import get_model
    from meshpact.core.scenario import deployment_of, with_overrides

    deployment = deployment_of(deployment).value
    if (gamma is None) != (acceptance is None):
        raise ScenarioError(
            "--speculative and --acceptance: expected both (draft tokens per round and the "
            "acceptance rate of one draft token) or neither"
        )
    if gamma is not None and acceptance is not None:
        if gamma < 1 or not 0.0 <= acceptance < 1.0:
            raise ScenarioError(f"--speculative {gamma} --acceptance {acceptance}: expected GAMMA >= 1 and 0 <= A < 1")
        spec = scenario.serving.speculative if scenario.serving is not None else None
        ratio = spec.draft_cost_ratio if spec is not None else DEFAULT_DRAFT_COST_RATIO
        scenario = with_overrides(
            scenario,
            {"serving.speculative": {"gamma": gamma, "alpha": acceptance, "draft_cost_ratio": ratio}},
            source=f"{scenario.name} (speculative)",
        )
    if deployment == "requests":
        return simulate_serving(scenario, link_gbps=link_gbps, **flags)
    overrides = serving_overrides(**flags)
    if overrides:
        scenario = with_overrides(scenario, overrides, source=f"{scenario.name} (overrides)")
    p = serving_params(scenario)
    if p.arrival_rate_per_s:
        raise ScenarioError("--deployment model runs closed-loop clients: give --concurrency")
    if link_gbps is not None:
        if not link_gbps > 0:
            raise ScenarioError(f"--link-gbps: expected a positive bandwidth in Gbit/s, got {link_gbps}")
        p = replace(p, link_beta_s_per_byte=8e-9 / link_gbps)
    if p.gamma:
        p = replace(p, local_per_token_s=p.gamma * (p.draft_cost_ratio or 0.0) * p.remote_per_token_s)
    return simulate_split(p, get_model(p.model).hidden_size, prompt_tokens=1)
