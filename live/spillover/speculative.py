"""Speculative decoding across the link: a draft on host 1, the target on host 2 verifies.

Host 1 holds a draft (a perturbed copy of the target, :meth:`Decoder.perturbed`; how often
it agrees is measured, never assumed) and every client's sequence; host 2 holds the whole
target. A round, for every sequence at once:

1. host 1 drafts ``γ`` tokens greedily and sends one command per round: per slot its
   state, its request, its position and the ``γ + 1`` tokens to score (its last accepted
   token and the drafts);
2. host 2 scores them in one target pass (logits ``[batch, γ + 1, vocab]``, bfloat16);
3. the result comes back as a checked plan:

   * ``full``: the logits of all ``γ + 1`` positions cross, ``(γ + 1)·V·2`` bytes per
     sequence, and host 1 verifies (greedy: the drafts up to the first one the target
     would not have chosen are accepted, then the target's own token);
   * ``token`` (verification at the source): host 2 verifies and only the accepted
     length and the next token cross, an int64 pair per sequence;
   * ``owner_token``: the lowerer's ``owner_token`` plan over the ``γ + 1`` positions'
     logits: the target's choice at each position is made at the source and goes to the
     sequence's owner, ``(γ + 1)`` int64 per sequence, and host 1 verifies against them;
   * ``logprob``: verified at the source as ``token``, and the lowerer's ``logprob`` plan
     sends the log-probability of the target's choice at each of the ``γ + 1`` positions
     (float32, computed at the source): host 1 keeps those of the tokens it emits (the
     accepted drafts are the target's choices at their positions, then the next token).

Both verify the same bfloat16 logits with the same rule (:func:`verify`), so the outputs
are token-identical. Per run: the accepted length of every sequence-round, from which α
(the chance a draft token is accepted, given the previous one was) is estimated as
accepted / (accepted + rejections) and the tokens per target pass compared with
``(1 − α^(γ+1)) / (1 − α)``.
"""

from __future__ import annotations

import hashlib
import json
import time
from typing import Any, Mapping, Sequence


from .loop import (
    ACTIVE,
    EMPTY,
    NEW,
    CheckedPlans,
    ClosedLoop,
    ResultPlans,
    handshake,
    mean_of,
    prompt_for,
    veth_counters,
    with_compiled,
)

__all__ = ["DRAFT_SCALE", "SPECULATIVE_REQUESTS", "verify", "acceptance", "digest", "serve", "spill"]

DRAFT_SCALE = 0.05  # the draft's weights: the target's plus noise of this many standard deviations
# full: logits of every position; token: verified at the source; owner_token: the target's choices per
# position to their owner; logprob: verified at the source with the emitted tokens' log-probabilities
SPECULATIVE_REQUESTS = ("full", "logprob", "token", "owner_token")


def verify(drafts: Any, chosen: Any) -> tuple[list[int], list[int]]:
    """Greedy verification: ``drafts [b, γ]`` against the target's choices ``chosen [b, γ + 1]``:
    per row the accepted length ``k`` (leading drafts equal to the target's choice) and the
    next token (the target's choice at ``k``)."""
    agree = (drafts == chosen[:, :-1]).long()
    k = agree.cumprod(dim=1).sum(dim=1)
    nxt = chosen.gather(1, k[:, None])[:, 0]
    return [int(x) for x in k], [int(x) for x in nxt]


def acceptance(accepted: Sequence[int], gamma: int) -> tuple[float, float]:
    """(α, tokens per target pass) from each sequence-round's accepted length: α counts each
    accepted draft token against each rejection (a round that accepted all ``γ`` had none)."""
    rejections = sum(1 for k in accepted if k < gamma)
    total = sum(accepted)
    alpha = total / (total + rejections) if total + rejections else 0.0
    return alpha, (total + len(accepted)) / len(accepted) if accepted else 0.0


def digest(outputs: Mapping[Any, Sequence[int]]) -> str:
    """A short fingerprint of every request's output ids (equal outputs, equal digests)."""
    text = json.dumps({str(k): list(v) for k, v in sorted(outputs.items(), key=lambda kv: int(kv[0]))})
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _verdict_plans(mesh: Any) -> Any:
    """The checked plan per batch for host 2's verdict ``[batch, 2]`` (accepted length, next token)."""

    class VerdictPlans(CheckedPlans):
        what = "verdict"

        def edge(self, rows: int) -> Any:
            from meshpact.core.facts import Consumer, DType, Edge, ProducerTensor, Request
            from meshpact.core.placement import Replicate

            prod, cons = mesh.domains[1], mesh.domains[0]
            return Edge(
                f"verdict_{rows}",
                mesh,
                ProducerTensor("verdict", "verify", (rows, 2), DType.INT64, prod.name, Replicate()),
                Consumer("drafter", cons.name, cons.ranks, Request.FULL),
                description="accepted length and next token per sequence, verified at the source",
            )

    return VerdictPlans()


def _words(gamma: int) -> int:
    return 3 + gamma + 1  # state, request, position, the tokens to score


def _command_size(slots: int, gamma: int) -> int:
    return 2 + slots * _words(gamma)


def _plain_target(cfg: Mapping[str, Any]) -> Any:
    from .decoder import Decoder, scaled_spec

    return Decoder(
        scaled_spec(cfg["model"]),
        cfg["concurrency"],
        cfg["prompt_tokens"] + cfg["output_tokens"] + cfg["gamma"] + 2,
        seed=cfg["seed"] + 2,
    )


def target_model(cfg: Mapping[str, Any]) -> Any:
    """Host 2's target, scoring ``γ + 1`` positions per pass (compiled when ``cfg`` asks for it)."""
    model = _plain_target(cfg)
    return with_compiled(cfg, model, [(model.whole, cfg["gamma"] + 1)])


def draft_model(cfg: Mapping[str, Any]) -> Any:
    """Host 1's draft: the target perturbed (:data:`DRAFT_SCALE`), one token per step."""
    model = _plain_target(cfg).perturbed(DRAFT_SCALE, cfg["seed"] + 99)
    return with_compiled(cfg, model, [(model.whole, 1)])


# -- host 1: clients, the draft, the verification of full logits ------------------------------------
def serve(cfg: Mapping[str, Any], layout: Any) -> dict:
    import torch
    import torch.distributed as dist

    from ..plans.executor import Executor

    gamma, n, req = cfg["gamma"], cfg["concurrency"], cfg["request"]
    draft = draft_model(cfg)
    vocab = draft.spec.vocab_size
    logit_plans, verdict_plans = ResultPlans("full", vocab, layout.mesh), _verdict_plans(layout.mesh)
    choice_plans = ResultPlans(req, vocab, layout.mesh)  # owner_token and logprob: the lowerer's plan per position
    executor = Executor(layout)
    alpha_link = handshake(0)
    draft.step([0], [0])  # warm up
    dist.barrier()
    before = veth_counters()
    t_start = time.perf_counter()
    clients = ClosedLoop(cfg["requests"])
    pending = clients.pending
    free = list(range(n))
    rid_of: dict[int, int] = {}
    pos: dict[int, int] = {}  # tokens the target has accepted into each slot's cache
    feed: dict[int, list[int]] = {}  # tokens the draft still has to read before drafting
    outputs: dict[int, list[int]] = {}
    logprobs: dict[int, list[float]] = {}  # logprob: the emitted tokens' log-probabilities under the target
    accepted: list[int] = []
    t_draft: list[float] = []
    t_verify: list[float] = []
    t_prefill: list[float] = []
    rounds = 0

    clients.start(n)
    while not clients.finished:
        new = []
        while pending and free:
            s, rid = free.pop(0), pending.popleft()
            prompt = prompt_for(cfg, rid, vocab)
            tp = time.perf_counter()
            draft.prefill(s, prompt)
            t_prefill.append(time.perf_counter() - tp)
            rid_of[s], pos[s], feed[s], outputs[rid], logprobs[rid] = rid, len(prompt) - 1, [prompt[-1]], [], []
            new.append(s)
        batch = sorted(rid_of)
        t0 = time.perf_counter()
        behind = [s for s in batch if len(feed[s]) > 1]  # all γ accepted last round: read the last draft
        if behind:
            draft.step(behind, [feed[s][0] for s in behind])
        last = [feed[s][-1] for s in batch]
        drafts = []
        toks = last
        for _ in range(gamma):
            toks = [int(x) for x in draft.step(batch, toks).to(torch.bfloat16).argmax(dim=-1)]
            drafts.append(toks)
        d = torch.tensor(drafts, dtype=torch.long).T.reshape(len(batch), gamma)
        t_draft.append(time.perf_counter() - t0)
        rounds += 1
        words: list[int] = []
        for s in range(n):
            if s in rid_of:
                j = batch.index(s)
                words += [NEW if s in new else ACTIVE, rid_of[s], pos[s], last[j], *d[j].tolist()]
            else:
                words += [EMPTY] + [0] * (_words(gamma) - 1)
        dist.send(torch.tensor([1, rounds, *words], dtype=torch.long), dst=1)
        if req in ("full", "owner_token"):  # the logits of every position, or the target's choice at each
            rows = len(batch) * (gamma + 1)
            plan, contract = (logit_plans if req == "full" else choice_plans).get(rows)
            meta = torch.empty(rows, vocab, dtype=torch.bfloat16, device="meta")
            got = next(iter(executor.run(plan, contract, {0: {}, 1: {"logits": meta}}).delivered.values()))
            t1 = time.perf_counter()
            k, nxt = verify(d, (got.argmax(dim=-1) if req == "full" else got).reshape(len(batch), gamma + 1))
            t_verify.append(time.perf_counter() - t1)
        else:
            plan, contract = verdict_plans.get(len(batch))
            meta = torch.empty(len(batch), 2, dtype=torch.long, device="meta")
            verdict = next(iter(executor.run(plan, contract, {0: {}, 1: {"verdict": meta}}).delivered.values()))
            k, nxt = [int(x) for x in verdict[:, 0]], [int(x) for x in verdict[:, 1]]
            if req == "logprob":  # the ids are the target's choices, known only at the source: a stand-in here
                rows = len(batch) * (gamma + 1)
                plan, contract = choice_plans.get(rows)
                meta = torch.empty(rows, vocab, dtype=torch.bfloat16, device="meta")
                lp = next(
                    iter(
                        executor.run(
                            plan, contract, {0: {}, 1: {"logits": meta}}, torch.zeros(rows, dtype=torch.long)
                        ).delivered.values()
                    )
                )
                lp = lp.reshape(len(batch), gamma + 1)
        finished = []
        for j, s in enumerate(batch):
            accepted.append(k[j])
            tokens = [*d[j, : k[j]].tolist(), nxt[j]]
            rid = rid_of[s]
            keep = cfg["output_tokens"] - len(outputs[rid])
            outputs[rid] += tokens[:keep]
            if req == "logprob":
                logprobs[rid] += [float(x) for x in lp[j, : k[j] + 1][:keep]]
            pos[s] += k[j] + 1
            draft.set_length(s, pos[s] if k[j] < gamma else pos[s] - 1)
            feed[s] = [nxt[j]] if k[j] < gamma else [int(d[j, gamma - 1]), nxt[j]]
            if len(outputs[rid]) >= cfg["output_tokens"]:
                finished.append(s)
        for s in finished:
            rid = rid_of.pop(s)
            clients.complete(rid)
            free.append(s)
    dist.send(torch.zeros(_command_size(n, gamma), dtype=torch.long), dst=1)
    makespan = time.perf_counter() - t_start
    after = veth_counters()
    alpha, per_pass = acceptance(accepted, gamma)
    return {
        "makespan_s": makespan,
        "latencies": clients.latencies,
        "spilled": cfg["requests"],
        "remote_tokens": cfg["requests"] * cfg["output_tokens"],
        "local_steps": rounds,
        "local_step_s": mean_of(t_draft),
        "local_prefill_s": mean_of(t_prefill),
        "sample_s": mean_of(t_verify),
        "veth_rx": after[0] - before[0],
        "veth_tx": after[1] - before[1],
        "alpha_s": alpha_link,
        "command_bytes": rounds * _command_size(n, gamma) * 8,
        "records": [r.to_dict() for r in executor.meter.records],
        "outputs": {str(k): v for k, v in outputs.items()},
        "logprobs": {str(k): v for k, v in logprobs.items()} if req == "logprob" else {},
        "speculative": {
            "gamma": gamma,
            "rounds": rounds,
            "sequence_rounds": len(accepted),
            "accepted_draft_tokens": sum(accepted),
            "alpha": alpha,
            "tokens_per_pass": per_pass,
            "draft_s": mean_of(t_draft),
        },
    }


# -- host 2: the target scores every position, and verifies at the source -----------------------------
def spill(cfg: Mapping[str, Any], layout: Any) -> dict:
    import torch
    import torch.distributed as dist

    from ..plans.executor import Executor

    gamma, n, req = cfg["gamma"], cfg["concurrency"], cfg["request"]
    target = target_model(cfg)
    vocab = target.spec.vocab_size
    logit_plans, verdict_plans = ResultPlans("full", vocab, layout.mesh), _verdict_plans(layout.mesh)
    choice_plans = ResultPlans(req, vocab, layout.mesh)
    executor = Executor(layout)
    cmd = torch.zeros(_command_size(n, gamma), dtype=torch.long)
    w = _words(gamma)
    t_forward: list[float] = []
    t_project: list[float] = []
    t_prefill: list[float] = []
    planned = {"startups": 0, "payload_bytes": 0}
    handshake(1)
    target.score([0], torch.zeros(1, gamma + 1, dtype=torch.long), [0])  # warm up (a pass of γ + 1 positions)
    dist.barrier()
    while True:
        dist.recv(cmd, src=0)
        if int(cmd[0]) == 0:
            break
        slots, start, rows = [], [], []
        for s in range(n):
            word = cmd[2 + w * s : 2 + w * (s + 1)]
            if int(word[0]) == EMPTY:
                continue
            if int(word[0]) == NEW:
                tp = time.perf_counter()
                target.prefill(s, prompt_for(cfg, int(word[1]), vocab))
                t_prefill.append(time.perf_counter() - tp)
            slots.append(s)
            start.append(int(word[2]))
            rows.append(word[3:])
        t0 = time.perf_counter()
        tokens = torch.stack(rows)
        logits = target.score(slots, tokens, start).to(torch.bfloat16)
        t1 = time.perf_counter()
        if req == "full":
            plan, contract = logit_plans.get(len(slots) * (gamma + 1))
            executor.run(plan, contract, {0: {}, 1: {"logits": logits.reshape(-1, vocab)}})
        elif req == "owner_token":
            plan, contract = choice_plans.get(len(slots) * (gamma + 1))
            executor.run(plan, contract, {0: {}, 1: {"logits": logits.reshape(-1, vocab)}})
        else:
            k, nxt = verify(tokens[:, 1:], logits.argmax(dim=-1))
            plan, contract = verdict_plans.get(len(slots))
            executor.run(plan, contract, {0: {}, 1: {"verdict": torch.tensor([k, nxt], dtype=torch.long).T}})
            if req == "logprob":  # the log-probability of the target's own choice at every position
                planned["startups"] += plan.startups
                planned["payload_bytes"] += plan.payload_bytes
                plan, contract = choice_plans.get(len(slots) * (gamma + 1))
                executor.run(
                    plan, contract, {0: {}, 1: {"logits": logits.reshape(-1, vocab)}}, logits.argmax(dim=-1).reshape(-1)
                )
        planned["startups"] += plan.startups
        planned["payload_bytes"] += plan.payload_bytes
        t_forward.append(t1 - t0)
        t_project.append(time.perf_counter() - t1)
    return {
        "records": [r.to_dict() for r in executor.meter.records],
        "steps": len(t_forward),
        "forward_s": mean_of(t_forward),
        "project_s": mean_of(t_project),
        "prefill_s": mean_of(t_prefill),
        "planned": planned,
    }
