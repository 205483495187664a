"""Two-host capacity spillover: a serving loop whose overflow runs on a second host.

This module is the ``requests`` deployment (whole requests spill) and the entry point of
every run (:func:`run_once`, :func:`worker`); the ``model`` deployment, the decoder split by
layers, is :mod:`.split`, and speculative decoding across the hosts is :mod:`.speculative`.

Host 1 (rank 0, domain ``cuda@host1``) serves ``concurrency`` closed-loop clients with a
fixed local capacity (``local_slots`` sequences decoded in lockstep by one batched step).
A request that finds the local slots full spills to host 2 (rank 1, domain ``cann@host2``),
which decodes its sequences the same way. The two hosts are network namespaces joined by
a ``tc``-shaped veth pair (:mod:`meshpact.live.netns`); the only path between them is that
link.

Every step of host 2 produces logits ``[batch, vocab]`` (bfloat16) and their result comes
back as the planner's plan for the request (``compile_contract`` → ``lower``), admitted by
the checker and run by the metered :class:`~meshpact.live.plans.executor.Executor` over the gloo
bridge:

* ``full``: the logits cross; host 1 samples (greedy) and the chosen ids go back with the
  next step's command, so host 2 waits for them (full-logit reconstruction);
* ``token`` / ``owner_token``: the id is chosen at the source and only it crosses;
* ``logprob``: the request scores a given continuation (its target ids, which both hosts
  derive from the request), so host 2 feeds the targets and sends one log-probability per
  row.

Host 1 drives host 2 with one fixed-size command per step over the world group (which
slots run, new requests, and for ``full`` the chosen ids); except for ``full`` it sends
step *k+1*'s command before reading step *k*'s results, so source projection never stalls
host 2's decoding. Counted per run: tokens/s, per-request latency, result traffic as
metered by the executor and as counted by the kernel on host 1's veth end (received
bytes: the result direction), startups, the α of the link (a timed ping-pong) and every
timed forward pass, from which :mod:`meshpact.spillover_sim` sets the simulator's parameters.
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field, replace
from enum import Enum
from typing import Any, Mapping, Sequence

from meshpact.core.errors import MeshpactError
from meshpact.core.jsonform import JsonObject
from meshpact.core.scenario import SERVING_REQUESTS, Deployment, deployment_of

from ..netns import LinkShape, TwoHosts
from . import speculative, split
from .loop import (
    ACTIVE,
    EMPTY,
    NEW,
    ClosedLoop,
    ResultPlans,
    handshake,
    mean_of,
    prompt_for,
    slot_word,
    targets_for,
    veth_counters,
    with_compiled,
)
from .speculative import SPECULATIVE_REQUESTS, digest
from .split import OutputCheck, compare

__all__ = [
    "SpilloverConfig",
    "RunResult",
    "SpeculativeStats",
    "Transfer",
    "transfers",
    "CompileMode",
    "COMPILE_MODES",
    "precompile",
    "run_once",
    "worker",
    "REQUESTS",
]

REQUESTS: tuple[str, ...] = tuple(r.value for r in SERVING_REQUESTS)
# requests: host 1 serves whole requests up to its slots and spills the rest to host 2;
# model: the decoder is split by layers, host 2 holds the later ones and the LM head (.split)


class CompileMode(str, Enum):
    """How the hosts run their decode steps."""

    EAGER = "eager"  # the decoders' Python steps
    AOTI = "aoti"  # compiled ahead of time with AOTInductor (.compiled.CompiledSteps), packages cached on disk


COMPILE_MODES = tuple(m.value for m in CompileMode)


@dataclass(frozen=True)
class SpilloverConfig:
    model: str = "dense"  # dense | moe | minimax (live.decoder.FAMILIES)
    request: str = "token"
    concurrency: int = 8
    requests: int = 32  # requests per run, all clients together
    output_tokens: int = 24
    prompt_tokens: int = 16
    local_slots: int = 4
    remote_slots: int = 12
    gbit_per_s: float = 1.0
    delay_ms: float = 0.0
    seed: int = 0
    timeout_s: float = 240.0
    deployment: str = Deployment.REQUESTS.value  # a Deployment
    gamma: int = 0  # speculative decoding: draft tokens per round (0: none; the model deployment only)
    compile: str = "eager"  # COMPILE_MODES
    work_dir: str = ""  # where compiled packages are cached (aoti/ under it); empty: the system's temp dir

    def __post_init__(self) -> None:
        from .decoder import FAMILIES

        object.__setattr__(self, "deployment", deployment_of(self.deployment).value)
        if self.compile not in COMPILE_MODES:
            raise MeshpactError(f"--compile {self.compile!r}: expected one of {', '.join(COMPILE_MODES)}")
        if self.gamma < 0 or self.gamma > 16:
            raise MeshpactError(f"--speculative {self.gamma}: expected 1..16 draft tokens per round (0: none)")
        if self.gamma:
            if self.deployment != "model":
                raise MeshpactError(
                    "--speculative: expected --deployment model (a draft on host 1, the target on host 2)"
                )
            if self.request not in SPECULATIVE_REQUESTS:
                raise MeshpactError(
                    f"--speculative with --request {self.request!r}: expected one of "
                    f"{', '.join(SPECULATIVE_REQUESTS)} (full logits, or verified at the source)"
                )
        if self.model not in FAMILIES:
            raise MeshpactError(f"--model {self.model!r}: expected one of {', '.join(FAMILIES)}")
        if self.request not in REQUESTS:
            raise MeshpactError(f"--request {self.request!r}: expected one of {', '.join(REQUESTS)}")
        for name in ("concurrency", "requests", "output_tokens", "local_slots", "remote_slots"):
            if getattr(self, name) < 1:
                raise MeshpactError(f"{name}: expected a positive integer, got {getattr(self, name)}")
        if self.prompt_tokens < 1:
            raise MeshpactError(f"prompt_tokens: expected at least 1, got {self.prompt_tokens}")
        if self.concurrency > self.local_slots + self.remote_slots:
            raise MeshpactError(
                f"concurrency {self.concurrency} exceeds the two hosts' {self.local_slots} + "
                f"{self.remote_slots} slots; raise remote_slots or lower the concurrency"
            )
        LinkShape(self.gbit_per_s, self.delay_ms)

    @property
    def max_len(self) -> int:
        return self.prompt_tokens + self.output_tokens + 1

    @property
    def package_dir(self) -> str:
        """Where this run's compiled decode steps are cached (shared by runs of the same shapes)."""
        import tempfile

        return os.path.join(self.work_dir or os.path.join(tempfile.gettempdir(), "meshpact-spillover"), "aoti")

    def to_dict(self) -> JsonObject:
        """The fields, and the package directory the hosts load compiled steps from."""
        return {**asdict(self), "package_dir": self.package_dir}


@dataclass(frozen=True)
class SpeculativeStats:
    """What one speculative run measured: rounds, acceptance and the bytes each round moved."""

    gamma: int  # draft tokens per round
    rounds: int  # target passes (one per round, every sequence at once)
    sequence_rounds: int  # rounds summed over the sequences
    accepted_draft_tokens: int
    alpha: float  # measured: accepted draft tokens over accepted plus rejections
    tokens_per_pass: float  # measured tokens per sequence and target pass
    draft_s: float  # mean time host 1 drafts a round
    bytes_per_round: float = 0.0  # result payload per round, metered by the executor


@dataclass(frozen=True)
class Transfer:
    """One message across the link during serving, timed from both ends on the shared monotonic
    clock: from the sender's call to the receiver's return (the hosts are namespaces of one kernel)."""

    one_way_s: float
    payload_bytes: int


def transfers(
    sent: Sequence[Mapping[str, Any]], sender_t0: float, received: Sequence[Mapping[str, Any]], receiver_t0: float
) -> tuple[Transfer, ...]:
    """Pair each send call record with the receive of the same group and sequence number:
    the message's time in flight as the two hosts' meters saw it (start of the send to the end
    of the receive, so a receiver that was late adds nothing: it waited before the send)."""
    ends = {(r["group"], r["seq"]): receiver_t0 + r["t"] + r["seconds"] for r in received if r["op"] == "recv"}
    out = []
    for r in sent:
        end = ends.get((r["group"], r["seq"]))
        if r["op"] == "send" and end is not None:
            out.append(Transfer(end - (sender_t0 + r["t"]), int(r["contributed"])))
    return tuple(out)


@dataclass(frozen=True)
class RunResult:
    config: SpilloverConfig
    throughput_tok_s: float
    latencies_s: tuple[float, ...]
    makespan_s: float
    tokens: int
    remote_tokens: int
    spilled: int
    result_bytes: int  # payload bytes of the result plans, metered by the executor
    veth_bytes: int  # bytes host 1's veth end received during serving (kernel counter)
    veth_tx_bytes: int  # bytes host 1's veth end sent (commands, acks)
    command_bytes: int  # payload of host 1's step commands
    startups: int  # collective calls and bridge messages of the result plans
    steps: Mapping[str, int]  # decode steps per host
    link_alpha_s: float  # half the median round trip of a small message over the link
    local_step_s: float  # mean timed decode step of host 1 (forward and choice)
    remote_forward_s: float  # mean timed forward pass of host 2
    remote_project_s: float  # mean time of host 2's part of the result plan
    consumer_sample_s: float  # full: mean time host 1 takes to sample a remote step's logits
    local_prefill_s: float
    remote_prefill_s: float
    planned: Mapping[str, int] = field(default_factory=dict)  # startups/bytes the plans predict
    hidden_bytes: int = 0  # model deployment: payload of the hidden-state plans (host 1 -> host 2)
    boundary_s: float = 0.0  # model deployment: mean time host 1 spends sending a step's hidden states
    output_check: OutputCheck | None = None  # model deployment: live outputs against the reference
    local_critical_s: float = (
        0.0  # model deployment: host 1's part of a step's critical path (result in -> hidden states out)
    )
    remote_critical_s: float = (
        0.0  # model deployment: host 2's part of a step's critical path (command in -> result out, waits excluded)
    )
    outputs_digest: str | None = None  # model deployment: fingerprint of every request's output ids
    speculative: SpeculativeStats | None = None
    emitted_logprobs: tuple[tuple[float, ...], ...] = ()  # speculative logprob: per request, its tokens' log-probs
    transfers: tuple[Transfer, ...] = ()  # model deployment: every hidden-state and result message, timed end to end
    compile_s: float = 0.0  # aoti: seconds the parent spent compiling packages not yet cached (outside the run)

    def percentile(self, q: float) -> float:
        import numpy as np

        return float(np.percentile(self.latencies_s, q)) if self.latencies_s else 0.0

    def to_dict(self) -> JsonObject:
        d = {k: v for k, v in asdict(self).items() if k not in ("config", "latencies_s")}
        d["config"] = self.config.to_dict()
        d["latency_s"] = {"p50": self.percentile(50), "p99": self.percentile(99)}
        return d


def _mesh(link_alpha_s: float, beta: float) -> Any:
    from meshpact.core.facts import Domain, LinkClass, LinkParams, Mesh, Vendor

    return Mesh(
        domains=(Domain("cuda@host1", Vendor.CUDA, "host1", (0,)), Domain("cann@host2", Vendor.CANN, "host2", (1,))),
        links={LinkClass.ETHERNET: LinkParams(link_alpha_s, beta)},
    )


# -- the worker (both ranks) -------------------------------------------------------------------
def worker(args: dict) -> dict:
    """One rank of a spillover run (started by :func:`run_once` through the launcher)."""
    import torch

    from ..plans.domains import RankEnv, init_domains

    torch.set_num_threads(1)
    env = RankEnv.from_environ()
    _pin(env.rank)
    cfg = args
    mesh = _mesh(5e-5, 8.0 / (cfg["gbit_per_s"] * 1e9))
    layout = init_domains(mesh, env, timeout_s=cfg["timeout_s"])
    if cfg.get("gamma"):
        return (speculative.serve if env.rank == 0 else speculative.spill)(cfg, layout)
    if cfg.get("deployment") == "model":
        return (split.serve if env.rank == 0 else split.spill)(cfg, layout)
    if env.rank == 0:
        return _ServingHost(cfg, layout).run()
    return _SpillHost(cfg, layout).run()


def request_decoder(cfg: Mapping[str, Any], slots: int) -> Any:
    """A host's whole decoder in the requests deployment (both hosts hold the same weights),
    its steps compiled when the run asks for it."""
    from .decoder import Decoder, scaled_spec

    model = Decoder(
        scaled_spec(cfg["model"]), slots, cfg["prompt_tokens"] + cfg["output_tokens"] + 1, seed=cfg["seed"] + 2
    )
    return with_compiled(cfg, model, [(model.whole, 1)])


def precompile(cfg: Mapping[str, Any], package_dir: str) -> float:
    """Compile (in this process, before the hosts start) every package the run's hosts will
    load that is not cached yet; the seconds it took (0 when all were cached)."""
    from .compiled import CompiledSteps

    steps = CompiledSteps(package_dir)
    args = {**cfg, "compile": "eager"}  # build the decoders plainly, then compile what they need
    if cfg.get("gamma"):
        needs = [(speculative.draft_model(args), 1), (speculative.target_model(args), cfg["gamma"] + 1)]
        for model, tokens in needs:
            steps.ensure(model, model.whole, tokens)
    elif cfg.get("deployment") == "model":
        for index in (0, 1):
            part, model = split.part_model(args, index)
            steps.ensure(model, part, 1)
    else:
        model = request_decoder(args, cfg["local_slots"])
        steps.ensure(model, model.whole, 1)
    return steps.compile_s


def _pin(host: int) -> None:
    """Give each host its own CPU, as two machines would have: otherwise a host that waits for
    the link lends its CPU to the other and the comparison measures that, not the link."""
    cpus = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpus[host % len(cpus)]})


class _SpillHost:
    """Decodes spilled requests in lockstep, one command per step, results as the plan says."""

    def __init__(self, cfg: dict, layout: Any) -> None:
        import torch

        from .decoder import scaled_spec
        from ..plans.executor import Executor

        self.cfg, self.layout = cfg, layout
        self.spec = scaled_spec(cfg["model"])
        self.model = request_decoder(cfg, cfg["remote_slots"])
        self.plans = ResultPlans(cfg["request"], self.spec.vocab_size, layout.mesh)
        self.executor = Executor(layout)
        self.cmd = torch.zeros(2 + 3 * cfg["remote_slots"], dtype=torch.long)
        self.next_token: dict[int, int] = {}
        self.targets: dict[int, list[int]] = {}
        self.done: dict[int, int] = {}
        self.t_forward: list[float] = []
        self.t_project: list[float] = []
        self.t_prefill: list[float] = []
        self.planned = {"startups": 0, "payload_bytes": 0}

    def run(self) -> dict:
        import torch
        import torch.distributed as dist

        handshake(1)
        self.model.step([0], [0])  # warm up
        dist.barrier()
        req = self.cfg["request"]
        while True:
            dist.recv(self.cmd, src=0)
            if int(self.cmd[0]) == 0:
                break
            slots, feed = [], []
            for s in range(self.cfg["remote_slots"]):
                state, rid, token = (int(x) for x in self.cmd[2 + 3 * s : 5 + 3 * s])
                if state == EMPTY:
                    continue
                if state == NEW:
                    t0 = time.perf_counter()
                    prompt = prompt_for(self.cfg, rid, self.spec.vocab_size)
                    self.model.prefill(s, prompt)
                    self.t_prefill.append(time.perf_counter() - t0)
                    self.next_token[s], self.done[s] = prompt[-1], 0
                    self.targets[s] = targets_for(self.cfg, rid, self.spec.vocab_size)
                elif req == "full":
                    self.next_token[s] = token
                slots.append(s)
                feed.append(self.next_token[s])
            t0 = time.perf_counter()
            logits = self.model.step(slots, feed).to(torch.bfloat16)
            t1 = time.perf_counter()
            plan, contract = self.plans.get(len(slots))
            ids = torch.tensor([self.targets[s][self.done[s]] for s in slots]) if req == "logprob" else None
            out = self.executor.run(plan, contract, {0: {}, 1: {"logits": logits}}, ids)
            self.planned["startups"] += plan.startups
            self.planned["payload_bytes"] += plan.payload_bytes
            self.t_forward.append(t1 - t0)
            self.t_project.append(time.perf_counter() - t1)
            sent = _sent_buffer(plan)
            for j, s in enumerate(slots):
                if req == "logprob":
                    self.next_token[s] = self.targets[s][self.done[s]]
                elif req != "full":
                    self.next_token[s] = int(out.buffers[sent][j])
                self.done[s] += 1
        return {
            "records": [r.to_dict() for r in self.executor.meter.records],
            "steps": len(self.t_forward),
            "forward_s": mean_of(self.t_forward),
            "project_s": mean_of(self.t_project),
            "prefill_s": mean_of(self.t_prefill),
            "planned": self.planned,
        }


def _sent_buffer(plan: Any) -> str:
    from meshpact.core.plan import StepKind

    return next(s.inputs[0] for s in plan.steps if s.kind is StepKind.SEND)


class _ServingHost:
    """The serving host: clients, local lockstep decoding, and the driver of host 2."""

    def __init__(self, cfg: dict, layout: Any) -> None:
        from .decoder import scaled_spec
        from ..plans.executor import Executor

        self.cfg, self.layout = cfg, layout
        self.spec = scaled_spec(cfg["model"])
        self.model = request_decoder(cfg, cfg["local_slots"])
        self.plans = ResultPlans(cfg["request"], self.spec.vocab_size, layout.mesh)
        self.executor = Executor(layout)
        self.lock = threading.Condition()
        self.clients = ClosedLoop(cfg["requests"])  # its pending: issued, not yet placed
        self.local_pending: deque[int] = deque()
        self.remote_pending: deque[int] = deque()
        self.waiting: deque[int] = deque()
        self.local_used = self.remote_used = 0
        self.spilled = self.remote_tokens = 0
        self.t_local: list[float] = []
        self.t_prefill: list[float] = []
        self.t_sample: list[float] = []  # full: the consumer's sampling of each remote step
        self.targets: dict[int, list[int]] = {}  # local slot -> its request's target ids
        self.command_bytes = 0
        self.error: BaseException | None = None

    # -- clients and placement (under the lock) ------------------------------------------------
    def _place_issued(self) -> None:
        while self.clients.pending:
            self._place(self.clients.pending.popleft())

    def _place(self, rid: int) -> None:
        if self.local_used < self.cfg["local_slots"]:
            self.local_used += 1
            self.local_pending.append(rid)
        elif self.remote_used < self.cfg["remote_slots"]:
            self.remote_used += 1
            self.spilled += 1
            self.remote_pending.append(rid)
        else:
            self.waiting.append(rid)
        self.lock.notify_all()

    def _complete(self, rid: int, remote: bool) -> None:
        if remote:
            self.remote_used -= 1
        else:
            self.local_used -= 1
        if self.waiting:
            self._place(self.waiting.popleft())
        self.clients.complete(rid)
        self._place_issued()
        self.lock.notify_all()

    def _finished(self) -> bool:
        return self.clients.finished

    # -- the run ---------------------------------------------------------------------------------
    def run(self) -> dict:
        import torch.distributed as dist

        alpha = handshake(0)
        self.model.step([0], [0])  # warm up
        dist.barrier()
        before = veth_counters()
        t0 = time.perf_counter()
        with self.lock:
            self.clients.start(self.cfg["concurrency"])
            self._place_issued()
        driver = threading.Thread(target=self._drive_remote, name="remote-driver")
        driver.start()
        try:
            self._decode_local()
        finally:
            driver.join()
        makespan = time.perf_counter() - t0
        after = veth_counters()
        if self.error is not None:
            raise self.error
        return {
            "makespan_s": makespan,
            "latencies": self.clients.latencies,
            "spilled": self.spilled,
            "remote_tokens": self.remote_tokens,
            "local_steps": len(self.t_local),
            "local_step_s": mean_of(self.t_local),
            "local_prefill_s": mean_of(self.t_prefill),
            "sample_s": mean_of(self.t_sample),
            "veth_rx": after[0] - before[0],
            "veth_tx": after[1] - before[1],
            "alpha_s": alpha,
            "command_bytes": self.command_bytes,
            "records": [r.to_dict() for r in self.executor.meter.records],
        }

    def _choose(self, logits: Any, rows: Sequence[tuple[int, int]]) -> list[int]:
        """The consumer's choice per row: greedy over the bfloat16 logits, or the target when scoring."""
        if self.cfg["request"] == "logprob":
            return [self.targets[s][k] for s, k in rows]
        return [int(x) for x in logits.argmax(dim=-1)]

    def _decode_local(self) -> None:
        import torch

        n = self.cfg["local_slots"]
        rid_of: dict[int, int] = {}
        token: dict[int, int] = {}
        done: dict[int, int] = {}
        free = list(range(n))
        while True:
            with self.lock:
                while not self.local_pending and not rid_of and not self._finished() and self.error is None:
                    self.lock.wait(0.5)
                if (self._finished() and not rid_of) or self.error is not None:
                    return
                admit = [self.local_pending.popleft() for _ in range(len(self.local_pending))]
            for rid in admit:
                s = free.pop()
                t0 = time.perf_counter()
                prompt = prompt_for(self.cfg, rid, self.spec.vocab_size)
                self.model.prefill(s, prompt)
                self.t_prefill.append(time.perf_counter() - t0)
                rid_of[s], token[s], done[s] = rid, prompt[-1], 0
                self.targets[s] = targets_for(self.cfg, rid, self.spec.vocab_size)
            slots = sorted(rid_of)
            t0 = time.perf_counter()
            logits = self.model.step(slots, [token[s] for s in slots]).to(torch.bfloat16)
            chosen = self._choose(logits, [(s, done[s]) for s in slots])
            self.t_local.append(time.perf_counter() - t0)
            finished = []
            for s, tok in zip(slots, chosen):
                token[s] = tok
                done[s] += 1
                if done[s] == self.cfg["output_tokens"]:
                    finished.append(s)
            with self.lock:
                for s in finished:
                    self._complete(rid_of.pop(s), remote=False)
                    free.append(s)

    def _drive_remote(self) -> None:
        try:
            self._drive()
        except BaseException as exc:  # surfaced by run()
            with self.lock:
                self.error = exc
                self.lock.notify_all()

    def _drive(self) -> None:
        import torch
        import torch.distributed as dist

        n, out_tokens = self.cfg["remote_slots"], self.cfg["output_tokens"]
        full = self.cfg["request"] == "full"
        rid_of: dict[int, int] = {}  # slot -> request
        commanded: dict[int, int] = {}  # steps commanded per slot
        received: dict[int, int] = {}  # results received per slot
        chosen: dict[int, int] = {}  # full: the consumer's last choice per slot
        inflight: deque[list[int]] = deque()
        sending: Any = None  # the last command's isend: gloo sends rendezvous with the receiver
        step = 0
        while True:
            with self.lock:
                while (
                    not self.remote_pending
                    and not any(commanded[s] < out_tokens for s in rid_of)
                    and not inflight
                    and not self._finished()
                    and self.error is None
                ):
                    self.lock.wait(0.5)
                if self.error is not None:
                    return
                words: list[int] = []
                batch: list[int] = []
                free = [s for s in range(n) if s not in rid_of]
                new = {}
                while self.remote_pending and free:
                    s = free.pop(0)
                    new[s] = self.remote_pending.popleft()
                for s in range(n):
                    if s in new:
                        rid_of[s], commanded[s], received[s] = new[s], 0, 0
                        words += slot_word(NEW, new[s], 0)
                    elif s in rid_of and commanded[s] < out_tokens:
                        words += slot_word(ACTIVE, rid_of[s], chosen.get(s, 0) if full else 0)
                    else:
                        words += slot_word(EMPTY, 0, 0)
                        continue
                    batch.append(s)
                    commanded[s] += 1
                if not batch and not inflight and self._finished():
                    if sending is not None:
                        sending.wait()
                    dist.send(torch.zeros(2 + 3 * n, dtype=torch.long), dst=1)
                    return
            if batch:
                step += 1
                cmd = torch.tensor([1, step, *words], dtype=torch.long)
                if sending is not None:
                    sending.wait()
                sending = dist.isend(cmd, dst=1)
                self.command_bytes += cmd.numel() * cmd.element_size()
                inflight.append(batch)
            if inflight and (full or len(inflight) > 1 or not batch):
                self._receive(inflight.popleft(), rid_of, received, chosen)

    def _receive(
        self, batch: list[int], rid_of: dict[int, int], received: dict[int, int], chosen: dict[int, int]
    ) -> None:
        import torch

        plan, contract = self.plans.get(len(batch))
        meta = torch.empty(len(batch), self.spec.vocab_size, dtype=torch.bfloat16, device="meta")
        ids = torch.zeros(len(batch), dtype=torch.long) if self.cfg["request"] == "logprob" else None
        out = self.executor.run(plan, contract, {0: {}, 1: {"logits": meta}}, ids)
        value = next(iter(out.delivered.values()))
        if self.cfg["request"] == "full":
            t0 = time.perf_counter()
            for s, tok in zip(batch, (int(x) for x in value.argmax(dim=-1))):
                chosen[s] = tok
            self.t_sample.append(time.perf_counter() - t0)
        with self.lock:
            self.remote_tokens += len(batch)
            for s in batch:
                received[s] += 1
                if received[s] == self.cfg["output_tokens"]:
                    self._complete(rid_of.pop(s), remote=True)


# -- the parent: one run on two fresh hosts ------------------------------------------------------
def run_once(cfg: SpilloverConfig, forkserver: Any = None) -> RunResult:
    """Build two hosts, start one rank on each, serve ``cfg``'s requests, tear everything down.
    ``forkserver``: a running :class:`~meshpact.live.launch.forkserver.ForkServer` to fork the two
    ranks from, each into its host's namespace (a caller that times no rank's start); else each
    rank is a fresh interpreter started there."""
    from ..launch.agentjob import AgentJob
    from ..launch.launcher import LaunchError
    from ..plans.meter import CallRecord, measure

    compile_s = precompile(cfg.to_dict(), cfg.package_dir) if cfg.compile == "aoti" else 0.0
    # rank r on host r, rank 0 hosting the job's store on its end of the link; the agent runs with this
    # thread on host 0, where that address (and the control channel it hosts beside it) is reached
    with TwoHosts(LinkShape(cfg.gbit_per_s, cfg.delay_ms)) as hosts, hosts.inside(0):
        port = random.randrange(20000, 60000)  # fresh namespaces: every port is free
        with AgentJob(
            "meshpact.live.spillover.serving:worker",
            2,
            cfg.to_dict(),
            timeout_s=cfg.timeout_s,
            master=(hosts.addr[0], port),
            prefix=hosts.prefix,
            forkserver=forkserver,
            env=lambda r: {
                "GLOO_SOCKET_IFNAME": hosts.iface[r],
                "MESHPACT_VETH": hosts.iface[r],
                "TORCHELASTIC_USE_AGENT_STORE": "False",
                "OMP_NUM_THREADS": "1",
            },
        ) as job:
            results = job.run().results
    bad = [r for r in results if not r.ok]
    if bad:
        what = "timed out" if bad[0].returncode is None else f"exited with {bad[0].returncode}"
        raise LaunchError(f"spillover rank {bad[0].rank} {what}; its stderr ends:\n{bad[0].stderr_tail}")
    h1, h2 = results[0].value, results[1].value
    measured = measure([CallRecord.from_dict(d) for d in h1["records"] + h2["records"]])
    tokens = cfg.requests * cfg.output_tokens
    result = RunResult(
        config=cfg,
        throughput_tok_s=tokens / h1["makespan_s"],
        latencies_s=tuple(h1["latencies"]),
        makespan_s=h1["makespan_s"],
        tokens=tokens,
        remote_tokens=h1["remote_tokens"],
        spilled=h1["spilled"],
        result_bytes=measured.payload_bytes,
        veth_bytes=h1["veth_rx"],
        veth_tx_bytes=h1["veth_tx"],
        command_bytes=h1["command_bytes"],
        startups=measured.startups,
        steps={"local": h1["local_steps"], "remote": h2["steps"]},
        link_alpha_s=h1["alpha_s"],
        local_step_s=h1["local_step_s"],
        remote_forward_s=h2["forward_s"],
        remote_project_s=h2["project_s"],
        consumer_sample_s=h1["sample_s"],
        local_prefill_s=h1["local_prefill_s"],
        remote_prefill_s=h2["prefill_s"],
        planned=h2["planned"],
        compile_s=compile_s,
    )
    if cfg.gamma:
        stats = SpeculativeStats(**h1["speculative"])
        per_round = measured.payload_bytes / stats.rounds if stats.rounds else 0.0
        return replace(
            result,
            outputs_digest=digest(h1["outputs"]),
            speculative=replace(stats, bytes_per_round=per_round),
            emitted_logprobs=tuple(tuple(v) for _, v in sorted((int(k), v) for k, v in h1["logprobs"].items())),
        )
    if cfg.deployment == "model":
        hidden = measure([CallRecord.from_dict(d) for d in h1["hidden_records"] + h2["hidden_records"]])
        check = compare(
            cfg.to_dict(),
            h1["schedule"],
            {int(k): v for k, v in h1["outputs"].items()},
            {int(k): v for k, v in h1["logprobs"].items()},
        )
        t0s = (h1["meter_t0"], h2["meter_t0"])
        timed = transfers(h1["hidden_records"], t0s[0]["hidden"], h2["hidden_records"], t0s[1]["hidden"]) + transfers(
            h2["records"], t0s[1]["result"], h1["records"], t0s[0]["result"]
        )
        return replace(
            result,
            hidden_bytes=hidden.payload_bytes,
            boundary_s=h1["boundary_s"],
            transfers=timed,
            output_check=check,
            local_critical_s=h1["critical_s"],
            outputs_digest=digest(h1["outputs"]),
            remote_critical_s=h2["critical_s"],
        )
    return result
