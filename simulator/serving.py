"""Serving with capacity spillover: two hosts of different vendors joined by an α-β link.

The model, with every parameter explicit (:class:`ServingParams`) so a measurement can be
set beside it:

* **Hosts.** Each host decodes up to ``slots`` sequences at once; one decode step (a
  target forward pass) of one sequence takes ``per_token_s``; the first token waits
  ``prefill_s``. A request takes a local slot when one is free, else a remote slot
  (spillover), else waits for whichever frees first, local preferred.
* **Link.** One SimPy resource per direction (full duplex), held for ``α + bytes·β`` per
  message, so messages queue behind each other: that is the contention.
* **Results.** Every decode iteration of a remote request sends its result to the local
  consumer as the plan the core lowerer emits for that request (:func:`result_plan`: the
  logits ``[tokens, V]`` in bf16 on the remote ranks, observed by the local consumer
  ranks): full logits are ``2·V`` bytes per token; a source projection sends a 4-byte
  fp32 log-prob or an 8-byte int64 token id; an owner token goes to the owning rank only,
  the others are broadcast inside the local domain. The plan's Ethernet bytes hold the
  link; its other steps (fabric collectives) add their α-β time to the message. For
  ``full`` the consumer samples from the logits, so the remote host waits for the result
  and for the chosen id (8 bytes) to come back before its next step; for the others the
  token is chosen at the source and results stream back without stalling decode. A
  request ends when its last result has arrived.
* **Speculative decoding** (optional). A draft proposes ``γ`` tokens at ``draft_cost_ratio``
  of a target pass each; the target verifies them in one pass; each draft token is
  accepted with probability ``α`` until the first rejection, and the pass adds one token of
  its own. The expected tokens per target pass are ``(1 − α^(γ+1)) / (1 − α)`` (Leviathan,
  Kalman and Matias 2023, "Fast Inference from Transformers via Speculative Decoding").
* **Load.** ``concurrency`` clients each keep one request in flight (closed loop), or
  requests arrive as a Poisson process at ``arrival_rate_per_s`` (open loop).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Mapping

import numpy as np
import simpy

from meshpact.core.catalog import get_model
from meshpact.core.errors import ScenarioError
from meshpact.core.contract import compile_contract
from meshpact.core.facts import (
    Consumer,
    Domain,
    DType,
    Edge,
    LinkClass,
    LinkParams,
    Mesh,
    ProducerTensor,
    Request,
    Vendor,
)
from meshpact.core.lowerer import lower
from meshpact.core.placement import Replicate, Shard
from meshpact.core.plan import Plan, plan_cost
from meshpact.core.scenario import Scenario, with_overrides

__all__ = [
    "DuplexLink",
    "ServingParams",
    "ServingResult",
    "serving_params",
    "result_plan",
    "served",
    "expected_tokens_per_pass",
    "simulate_serving",
    "simulate_params",
    "MODEL_PRESETS",
]

MODEL_PRESETS = ("dense", "moe", "minimax")  # Qwen3-14B, Qwen3-30B-A3B, MiniMax-M2 in the shipped scenario


_TOKEN_ID_BYTES = 8  # an int64 id, the dtype the lowerer gives token results


def expected_tokens_per_pass(gamma: int, alpha: float) -> float:
    """Closed form of the tokens one target pass yields (Leviathan et al. 2023, eq. 1)."""
    if alpha >= 1.0:
        return float(gamma + 1)
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


@dataclass(frozen=True)
class ServingParams:
    """Every number the serving model uses, in one record (``to_dict`` for reports)."""

    model: str
    vocab_size: int
    local_vendor: str
    remote_vendor: str
    local_slots: int
    remote_slots: int
    local_per_token_s: float
    remote_per_token_s: float
    local_prefill_s: float
    remote_prefill_s: float
    link_alpha_s: float
    link_beta_s_per_byte: float
    fabric_alpha_s: float
    fabric_beta_s_per_byte: float
    request: Request
    consumer_ranks: int
    producer_ranks: int
    concurrency: int
    arrival_rate_per_s: float | None
    output_tokens: int
    requests: int
    gamma: int | None = None
    alpha: float | None = None
    draft_cost_ratio: float | None = None
    seed: int = 0

    @property
    def link_gbit_per_s(self) -> float:
        return 8e-9 / self.link_beta_s_per_byte

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["request"] = self.request.value
        d["link_gbit_per_s"] = self.link_gbit_per_s
        return d


def _mesh(p: ServingParams) -> Mesh:
    local = Domain(
        name=f"{p.local_vendor}@local",
        vendor=Vendor(p.local_vendor),
        host="local",
        ranks=tuple(range(p.consumer_ranks)),
        bridge_rank=0,
    )
    remote = Domain(
        name=f"{p.remote_vendor}@remote",
        vendor=Vendor(p.remote_vendor),
        host="remote",
        ranks=tuple(range(p.consumer_ranks, p.consumer_ranks + p.producer_ranks)),
        bridge_rank=p.consumer_ranks,
    )
    return Mesh(
        domains=(local, remote),
        links={
            LinkClass.FABRIC: LinkParams(p.fabric_alpha_s, p.fabric_beta_s_per_byte),
            LinkClass.HOST_BRIDGE: LinkParams(p.fabric_alpha_s, p.fabric_beta_s_per_byte),
            LinkClass.ETHERNET: LinkParams(p.link_alpha_s, p.link_beta_s_per_byte),
        },
    )


def result_plan(p: ServingParams, tokens: int, owner: int = 0) -> Plan:
    """The lowerer's plan that carries ``tokens`` results of one remote sequence to the local
    consumer ranks (``owner``: the consumer rank that owns the sequence)."""
    mesh = _mesh(p)
    local, remote = mesh.domains
    placement = Shard(1) if p.producer_ranks > 1 else Replicate()
    producer = ProducerTensor(
        name="logits",
        op="lm_head",
        shape=(tokens, p.vocab_size),
        dtype=DType.BFLOAT16,
        domain=remote.name,
        placement=placement,
    )
    owners = (owner,) * tokens if p.request is Request.OWNER_TOKEN else None
    consumer = Consumer(name="sampler", domain=local.name, ranks=local.ranks, request=p.request, owners=owners)
    edge = Edge(name=f"remote-result/{p.request.value}", mesh=mesh, producer=producer, consumer=consumer)
    return lower(compile_contract(edge))


@dataclass(frozen=True)
class ServingResult:
    params: ServingParams
    throughput_tok_s: float
    latency_s: Mapping[str, float]
    result_bytes: int  # result bytes sent over the link
    bytes_received: int  # result bytes that arrived
    feedback_bytes: int  # chosen token ids sent back (full logits only)
    startups: int  # of every result plan executed, plus one per feedback message
    requests: int
    spilled: int
    local_tokens: int
    remote_tokens: int
    target_passes: int
    makespan_s: float
    link_busy_s: float
    mean_in_system: float  # time average of requests in the system
    arrival_rate_per_s: float  # completed requests over the makespan
    latencies: tuple[float, ...] = field(default=(), repr=False)

    @property
    def tokens_per_target_pass(self) -> float:
        return (self.local_tokens + self.remote_tokens) / self.target_passes if self.target_passes else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "throughput_tok_s": self.throughput_tok_s,
            "latency_s": dict(self.latency_s),
            "result_bytes": self.result_bytes,
            "startups": self.startups,
            "bytes_received": self.bytes_received,
            "feedback_bytes": self.feedback_bytes,
            "requests": self.requests,
            "spilled": self.spilled,
            "local_tokens": self.local_tokens,
            "remote_tokens": self.remote_tokens,
            "target_passes": self.target_passes,
            "tokens_per_target_pass": self.tokens_per_target_pass,
            "makespan_s": self.makespan_s,
            "link_utilization": self.link_busy_s / self.makespan_s if self.makespan_s else 0.0,
            "mean_in_system": self.mean_in_system,
            "params": self.params.to_dict(),
        }

    def to_frame(self) -> Any:
        import pandas as pd

        row = {k: v for k, v in self.to_dict().items() if k not in ("latency_s", "params")}
        row.update({f"latency_{k}_s": v for k, v in self.latency_s.items()})
        row.update(
            {
                "model": self.params.model,
                "request": self.params.request.value,
                "concurrency": self.params.concurrency,
                "link_gbit_per_s": self.params.link_gbit_per_s,
            }
        )
        return pd.DataFrame([row])


def serving_params(scenario: Scenario) -> ServingParams:
    s = scenario.serving
    if s is None:
        raise ScenarioError(
            f"{scenario.name}: serving: this scenario has no serving section; "
            "use scenarios/serving_spillover.yaml or add one"
        )
    preset = s.preset()
    link = s.link.params() if s.link else scenario.link(LinkClass.ETHERNET)
    fabric = scenario.link(LinkClass.FABRIC)
    spec = s.speculative
    return ServingParams(
        model=get_model(preset.model).name,
        vocab_size=get_model(preset.model).vocab_size,
        local_vendor=preset.local.vendor.value,
        remote_vendor=preset.remote.vendor.value,
        local_slots=preset.local.slots,
        remote_slots=preset.remote.slots,
        local_per_token_s=preset.local.per_token_s,
        remote_per_token_s=preset.remote.per_token_s,
        local_prefill_s=preset.local.prefill_s,
        remote_prefill_s=preset.remote.prefill_s,
        link_alpha_s=link.alpha_s,
        link_beta_s_per_byte=link.beta_s_per_byte,
        fabric_alpha_s=fabric.alpha_s,
        fabric_beta_s_per_byte=fabric.beta_s_per_byte,
        request=s.request,
        consumer_ranks=s.consumer_ranks,
        producer_ranks=s.producer_ranks,
        concurrency=s.concurrency,
        arrival_rate_per_s=s.arrival_rate_per_s,
        output_tokens=s.output_tokens,
        requests=s.requests,
        gamma=spec.gamma if spec else None,
        alpha=spec.alpha if spec else None,
        draft_cost_ratio=spec.draft_cost_ratio if spec else None,
        seed=s.seed,
    )


class DuplexLink:
    """The α-β link between the two hosts: one SimPy resource per direction, each carrying
    one message at a time, so messages queue behind each other (link contention)."""

    def __init__(self, env: simpy.Environment, params: LinkParams) -> None:
        self.env = env
        self.params = params
        self.uplink = simpy.Resource(env, 1)  # remote -> local
        self.downlink = simpy.Resource(env, 1)  # local -> remote
        self.busy_s = 0.0

    def send(self, direction: simpy.Resource, nbytes: int):
        """Process: wait for ``direction`` to be free, then hold it for α + β·bytes."""
        with direction.request() as req:
            yield req
            t = self.params.time_s(1, nbytes)
            yield self.env.timeout(t)
            self.busy_s += t


class _Serve:
    def __init__(self, p: ServingParams) -> None:
        self.p = p
        self.env = simpy.Environment()
        self.rng = np.random.default_rng(p.seed)
        self.hosts = {
            "local": simpy.Resource(self.env, p.local_slots),
            "remote": simpy.Resource(self.env, p.remote_slots),
        }
        self.link = DuplexLink(self.env, LinkParams(p.link_alpha_s, p.link_beta_s_per_byte))
        self.mesh = _mesh(p)
        self.plans: dict[int, tuple[Plan, int, float]] = {}
        self.sent = self.received = self.feedback = self.startups = 0
        self.spilled = self.local_tokens = self.remote_tokens = self.passes = 0
        self.latencies: list[float] = []
        self.in_system = 0
        self.area = 0.0  # integral of in_system over time
        self.last_change = 0.0
        self.issued = 0

    def _count(self, delta: int) -> None:
        now = self.env.now
        self.area += self.in_system * (now - self.last_change)
        self.in_system += delta
        self.last_change = now

    def _plan(self, tokens: int) -> tuple[Plan, int, float]:
        if tokens not in self.plans:
            plan = result_plan(self.p, tokens)
            cost = plan_cost(plan, self.mesh)
            eth = cost.bytes_by_link.get(LinkClass.ETHERNET.value, 0)
            local_s = cost.time_s - self.mesh.links[LinkClass.ETHERNET].time_s(1, eth)
            self.plans[tokens] = (plan, eth, local_s)
        return self.plans[tokens]

    def _send_result(self, tokens: int):
        plan, nbytes, local_s = self._plan(tokens)
        self.sent += nbytes
        self.startups += plan.startups
        yield from self.link.send(self.link.uplink, nbytes)
        self.received += nbytes
        if local_s:
            yield self.env.timeout(local_s)

    def _iteration(self, remaining: int) -> tuple[int, float]:
        """Tokens and duration (in units of a target pass) of one decode iteration."""
        p = self.p
        if p.gamma is None:
            return 1, 1.0
        accepted = min(p.gamma, int(self.rng.geometric(1.0 - p.alpha)) - 1) if p.alpha else 0
        return min(accepted + 1, remaining), 1.0 + p.gamma * (p.draft_cost_ratio or 0.0)

    def _acquire(self):
        local, remote = self.hosts["local"], self.hosts["remote"]
        if local.count < local.capacity:
            req = local.request()
            yield req
            return "local", req
        if remote.count < remote.capacity:
            req = remote.request()
            yield req
            return "remote", req
        rl, rr = local.request(), remote.request()
        got = yield rl | rr
        if rl in got:
            if rr.triggered:
                remote.release(rr)
            else:
                rr.cancel()
            return "local", rl
        if rl.triggered:
            local.release(rl)
        else:
            rl.cancel()
        return "remote", rr

    def request(self):
        p = self.p
        arrived = self.env.now
        self._count(+1)
        where, slot = yield from self._acquire()
        remote = where == "remote"
        self.spilled += remote
        per_token = p.remote_per_token_s if remote else p.local_per_token_s
        yield self.env.timeout(p.remote_prefill_s if remote else p.local_prefill_s)
        left, last = p.output_tokens, None
        while left > 0:
            k, passes = self._iteration(left)
            yield self.env.timeout(passes * per_token)
            self.passes += 1
            left -= k
            if not remote:
                self.local_tokens += k
                continue
            self.remote_tokens += k
            last = self.env.process(self._send_result(k))
            if p.request is Request.FULL:  # the consumer samples; the chosen ids travel back
                yield last
                nbytes = k * _TOKEN_ID_BYTES
                self.feedback += nbytes
                self.startups += 1
                yield from self.link.send(self.link.downlink, nbytes)
        self.hosts[where].release(slot)
        if last is not None and not last.processed:
            yield last
        self.latencies.append(self.env.now - arrived)
        self._count(-1)

    def client(self):
        while self.issued < self.p.requests:
            self.issued += 1
            yield self.env.process(self.request())

    def arrivals(self):
        procs = []
        rate = self.p.arrival_rate_per_s
        assert rate, "run() starts arrivals only for an open loop"
        while self.issued < self.p.requests:
            self.issued += 1
            procs.append(self.env.process(self.request()))
            yield self.env.timeout(float(self.rng.exponential(1.0 / rate)))
        yield self.env.all_of(procs)

    def run(self) -> ServingResult:
        p = self.p
        if p.arrival_rate_per_s:
            self.env.process(self.arrivals())
        else:
            for _ in range(p.concurrency):
                self.env.process(self.client())
        self.env.run()
        self._count(0)
        end = self.env.now
        return served(self, self.area / end if end else 0.0)


def served(sim: Any, mean_in_system: float) -> ServingResult:
    """What a finished run of ``sim`` served: either simulator (``_Serve`` here, the lockstep one in
    :mod:`.batching`) keeps its counters under these names; ``mean_in_system`` is each one's own."""
    end = sim.env.now
    lat = np.asarray(sim.latencies)
    return ServingResult(
        params=sim.p,
        throughput_tok_s=(sim.local_tokens + sim.remote_tokens) / end if end else 0.0,
        latency_s={
            "p50": float(np.percentile(lat, 50)),
            "p99": float(np.percentile(lat, 99)),
            "mean": float(lat.mean()),
        },
        result_bytes=sim.sent,
        bytes_received=sim.received,
        feedback_bytes=sim.feedback,
        startups=sim.startups,
        requests=len(lat),
        spilled=sim.spilled,
        local_tokens=sim.local_tokens,
        remote_tokens=sim.remote_tokens,
        target_passes=sim.passes,
        makespan_s=end,
        link_busy_s=sim.link.busy_s,
        mean_in_system=mean_in_system,
        arrival_rate_per_s=len(lat) / end if end else 0.0,
        latencies=tuple(float(x) for x in lat),
    )


def serving_overrides(
    *,
    model: str | None = None,
    concurrency: int | None = None,
    request: str | None = None,
    link_gbps: float | None = None,
    requests: int | None = None,
    output_tokens: int | None = None,
) -> dict[str, Any]:
    """Map the CLI's flags onto scenario fields (dotted paths)."""
    out: dict[str, Any] = {}
    if model is not None:
        out["serving.model"] = model
    if concurrency is not None:
        out["serving.concurrency"] = concurrency
        out["serving.arrival_rate_per_s"] = None
    if request is not None:
        out["serving.request"] = request
    if requests is not None:
        out["serving.requests"] = requests
    if output_tokens is not None:
        out["serving.output_tokens"] = output_tokens
    return out


def simulate_serving(
    scenario: Scenario,
    *,
    overrides: Mapping[str, Any] | None = None,
    link_gbps: float | None = None,
    progress: Callable[[int, int], None] | None = None,
    **flags: Any,
) -> ServingResult:
    """Simulate the scenario's serving section; ``flags``: model, concurrency, request, requests,
    output_tokens; ``link_gbps`` replaces the link's bandwidth (α stays)."""
    all_overrides = {**serving_overrides(**flags), **dict(overrides or {})}
    if all_overrides:
        scenario = with_overrides(scenario, all_overrides, source=f"{scenario.name} (overrides)")
    p = serving_params(scenario)
    if link_gbps is not None:
        if not link_gbps > 0:
            raise ScenarioError(f"--link-gbps: expected a positive bandwidth in Gbit/s, got {link_gbps}")
        p = replace(p, link_beta_s_per_byte=8e-9 / link_gbps)
    result = _Serve(p).run()
    if progress:
        progress(1, 1)
    return result


def simulate_params(p: ServingParams) -> ServingResult:
    """Simulate explicit parameters (e.g. calibrated from a live measurement), no scenario file."""
    return _Serve(p).run()
