"""Model-split serving: host 1 runs the first layers, host 2 the rest and the LM head.

The deployment where a model does not fit one vendor's host: the decoder is split by
layers (:func:`~meshpact.live.spillover.decoder.split_parts`). Host 1 (``cuda@host1``)
holds every sequence, embeds its tokens and runs the first part; host 2 (``cann@host2``)
runs the remaining layers, the final norm and the vocabulary-parallel LM head. So every
decode step of every request crosses the link, at concurrency 1 too:

1. host 1 sends a fixed-size step command (which slots run, which are new);
2. for a new sequence, the prompt's hidden states ``[prompt - 1, hidden]`` cross (prefill);
3. the step's hidden states ``[batch, hidden]`` (bfloat16) cross host 1 → host 2 as a
   checked plan (a ``full`` request of host 2: it needs every element);
4. host 2's logits ``[batch, vocab]`` come back as the lowerer's plan for the request:
   ``full`` ships the logits and host 1 chooses (greedy); ``token`` / ``owner_token``
   choose at the source; ``logprob`` scores the request's target continuation at the
   source (its targets are fed back, teacher forcing).

The next step needs the chosen ids, so host 1 waits for each step's result. Each host
also times its part of the step's critical path, the simulator's per-step compute: host 1
from the arrival of a step's result to the start of the next step's hidden-state send
(less prefills and their sends), host 2 from the arrival of the step's command to the
start of the result's send, less its waits inside receives and its prefills (the meter's
call records give the instants). Host 2 learns a step's shape from the command, so its
admission of the hidden-state plan is on the path; host 1 admits the result's plan while
host 2 computes, off it.
Host 1 keeps
the schedule (which slots joined and ran at each step) and every chosen id (and log-prob);
:func:`reference` replays that schedule in one process with the same two parts, and
:func:`compare` says where the live run's output first departs from it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from meshpact.core.jsonform import JsonObject

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
    slot_word,
    targets_for,
    veth_counters,
    with_compiled,
)

__all__ = ["SPLIT_AT", "serve", "spill", "reference", "compare", "OutputCheck"]

SPLIT_AT = 1  # host 1 runs layers [0, SPLIT_AT), host 2 the rest and the head


def _boundary_plans(hidden: int, mesh: Any) -> Any:
    """The checked plan per row count for hidden states ``[rows, hidden]`` going host 1 → host 2."""

    class BoundaryPlans(CheckedPlans):
        what = "hidden-state"

        def edge(self, rows: int) -> Any:
            from meshpact.core.facts import Consumer, DType, Edge, ProducerTensor, Request
            from meshpact.core.placement import Replicate

            prod, cons = mesh.domains[0], mesh.domains[1]
            return Edge(
                f"split_hidden_{rows}",
                mesh,
                ProducerTensor(
                    "hidden", f"layer_{SPLIT_AT - 1}", (rows, hidden), DType.BFLOAT16, prod.name, Replicate()
                ),
                Consumer("next_layers", cons.name, cons.ranks, Request.FULL),
                description="hidden states at the split, read by the host holding the later layers",
            )

    return BoundaryPlans()


def _last_call(executor: Any) -> tuple[float, float]:
    """(start, end) of ``executor``'s last link call, on the ``time.monotonic`` clock."""
    r = executor.meter.records[-1]
    return executor.meter.t0 + r.t, executor.meter.t0 + r.t + r.seconds


def _command_size(slots: int) -> int:
    return 2 + 3 * slots


# -- host 1: clients, the first layers, the choice -------------------------------------------
def part_model(cfg: Mapping[str, Any], index: int) -> tuple[Any, Any]:
    """Host ``index``'s part of the split decoder and a decoder holding only that part's
    weights (its steps compiled when ``cfg`` asks for it)."""
    from .decoder import LAYERS, Decoder, scaled_spec, split_parts

    part = split_parts(LAYERS, SPLIT_AT)[index]
    model = Decoder(
        scaled_spec(cfg["model"]),
        cfg["concurrency"],
        cfg["prompt_tokens"] + cfg["output_tokens"] + 1,
        seed=cfg["seed"] + 2,
    )
    model.keep_only(part)
    return part, with_compiled(cfg, model, [(part, 1)])


def _host_part(cfg: Mapping[str, Any], layout: Any, index: int) -> tuple[Any, Any, Any, Any, Any]:
    """Host ``index``'s share of the split decoder and the two plans every step runs:
    (spec, part, model holding only that part, boundary plans, result plans)."""
    part, model = part_model(cfg, index)
    spec = model.spec
    return (
        spec,
        part,
        model,
        _boundary_plans(spec.hidden, layout.mesh),
        ResultPlans(cfg["request"], spec.vocab_size, layout.mesh),
    )


def serve(cfg: Mapping[str, Any], layout: Any) -> dict:
    """Serve ``cfg["requests"]`` closed-loop requests from ``cfg["concurrency"]`` clients."""
    import torch
    import torch.distributed as dist

    from ..plans.executor import Executor

    spec, part, model, hidden_plans, result_plans = _host_part(cfg, layout, 0)
    hidden_exec, result_exec = Executor(layout), Executor(layout)
    n, req = cfg["concurrency"], cfg["request"]

    alpha = handshake(0)
    model.step_part([0], part, torch.tensor([0]))  # warm up
    dist.barrier()
    before = veth_counters()
    t_start = time.perf_counter()
    clients = ClosedLoop(cfg["requests"])
    pending = clients.pending
    free = list(range(n))
    rid_of: dict[int, int] = {}
    token: dict[int, int] = {}
    done: dict[int, int] = {}
    targets: dict[int, list[int]] = {}
    outputs: dict[int, list[int]] = {}
    logprobs: dict[int, list[float]] = {}
    schedule: list[dict[str, list]] = []
    t_step: list[float] = []
    t_prefill: list[float] = []
    t_sample: list[float] = []
    t_boundary: list[float] = []
    command_bytes = 0
    step = 0

    clients.start(n)
    critical: list[float] = []
    result_end: float | None = None  # when the last step's result arrived
    while not clients.finished:
        aside = 0.0  # prefills and their sends: the simulator charges them apart
        new: list[tuple[int, int]] = []
        while pending and free:
            new.append((free.pop(0), pending.popleft()))
        new.sort()
        step += 1
        words: list[int] = []
        joined = dict(new)
        for s in range(n):
            if s in joined:
                words += slot_word(NEW, joined[s], 0)
            elif s in rid_of:
                words += slot_word(ACTIVE, rid_of[s], 0)
            else:
                words += slot_word(EMPTY, 0, 0)
        cmd = torch.tensor([1, step, *words], dtype=torch.long)
        dist.send(cmd, dst=1)
        command_bytes += cmd.numel() * cmd.element_size()
        for s, rid in new:
            t0 = time.perf_counter()
            prompt = prompt_for(cfg, rid, spec.vocab_size)
            h = model.prefill_part(s, part, torch.tensor(prompt))
            t_prefill.append(time.perf_counter() - t0)
            if h is not None and h.shape[0]:
                plan, contract = hidden_plans.get(int(h.shape[0]))
                hidden_exec.run(plan, contract, {0: {"hidden": h}, 1: {}})
                aside += hidden_exec.meter.records[-1].seconds
            aside += t_prefill[-1]
            rid_of[s], token[s], done[s] = rid, prompt[-1], 0
            targets[s] = targets_for(cfg, rid, spec.vocab_size)
            outputs[rid], logprobs[rid] = [], []
        batch = sorted(rid_of)
        schedule.append({"new": [list(x) for x in new], "batch": batch})
        t0 = time.perf_counter()
        h = model.step_part(batch, part, torch.tensor([token[s] for s in batch]))
        t1 = time.perf_counter()
        plan, contract = hidden_plans.get(len(batch))
        hidden_exec.run(plan, contract, {0: {"hidden": h}, 1: {}})
        t_boundary.append(time.perf_counter() - t1)
        if result_end is not None:
            critical.append(_last_call(hidden_exec)[0] - result_end - aside)
        plan, contract = result_plans.get(len(batch))
        meta = torch.empty(len(batch), spec.vocab_size, dtype=torch.bfloat16, device="meta")
        ids = torch.tensor([targets[s][done[s]] for s in batch]) if req == "logprob" else None
        out = result_exec.run(plan, contract, {0: {}, 1: {"logits": meta}}, ids)
        result_end = _last_call(result_exec)[1]
        value = next(iter(out.delivered.values()))
        t2 = time.perf_counter()
        if req == "full":
            chosen = [int(x) for x in value.argmax(dim=-1)]
        elif req == "logprob":
            chosen = [targets[s][done[s]] for s in batch]
        else:
            chosen = [int(x) for x in value]
        t_sample.append(time.perf_counter() - t2)
        t_step.append((t1 - t0) + (time.perf_counter() - t2))
        finished = []
        for j, s in enumerate(batch):
            rid = rid_of[s]
            outputs[rid].append(chosen[j])
            if req == "logprob":
                logprobs[rid].append(float(value[j]))
            token[s] = chosen[j]
            done[s] += 1
            if done[s] == cfg["output_tokens"]:
                finished.append(s)
        for s in finished:
            rid = rid_of.pop(s)
            clients.complete(rid)
            free.append(s)
    dist.send(torch.zeros(_command_size(n), dtype=torch.long), dst=1)
    makespan = time.perf_counter() - t_start
    after = veth_counters()
    return {
        "makespan_s": makespan,
        "latencies": clients.latencies,
        "spilled": cfg["requests"],
        "remote_tokens": cfg["requests"] * cfg["output_tokens"],
        "local_steps": len(t_step),
        "local_step_s": mean_of(t_step),
        "local_prefill_s": mean_of(t_prefill),
        "sample_s": mean_of(t_sample) if req == "full" else 0.0,
        "boundary_s": mean_of(t_boundary),
        "critical_s": mean_of(critical),
        "veth_rx": after[0] - before[0],
        "veth_tx": after[1] - before[1],
        "alpha_s": alpha,
        "command_bytes": command_bytes,
        "records": [r.to_dict() for r in result_exec.meter.records],
        "hidden_records": [r.to_dict() for r in hidden_exec.meter.records],
        "meter_t0": {"result": result_exec.meter.t0, "hidden": hidden_exec.meter.t0},
        "schedule": schedule,
        "outputs": {str(k): v for k, v in outputs.items()},
        "logprobs": {str(k): v for k, v in logprobs.items()} if req == "logprob" else {},
    }


# -- host 2: the later layers, the head, the result plan --------------------------------------
def spill(cfg: Mapping[str, Any], layout: Any) -> dict:
    """Run the later layers and the LM head for every step host 1 commands."""
    import torch
    import torch.distributed as dist

    from ..plans.executor import Executor

    spec, part, model, hidden_plans, result_plans = _host_part(cfg, layout, 1)
    hidden_exec, result_exec = Executor(layout), Executor(layout)
    n, req = cfg["concurrency"], cfg["request"]
    cmd = torch.zeros(_command_size(n), dtype=torch.long)
    targets: dict[int, list[int]] = {}
    done: dict[int, int] = {}
    t_forward: list[float] = []
    t_project: list[float] = []
    t_prefill: list[float] = []
    planned = {"startups": 0, "payload_bytes": 0}

    def receive(rows: int) -> Any:
        plan, contract = hidden_plans.get(rows)
        meta = torch.empty(rows, spec.hidden, dtype=torch.bfloat16, device="meta")
        return next(iter(hidden_exec.run(plan, contract, {0: {"hidden": meta}, 1: {}}).delivered.values()))

    handshake(1)
    model.step_part([0], part, torch.zeros(1, spec.hidden, dtype=torch.bfloat16))  # warm up
    dist.barrier()
    critical: list[float] = []
    while True:
        dist.recv(cmd, src=0)
        if int(cmd[0]) == 0:
            break
        start, waited = time.monotonic(), 0.0
        slots = []
        for s in range(n):
            state, rid, _ = (int(x) for x in cmd[2 + 3 * s : 5 + 3 * s])
            if state == EMPTY:
                continue
            if state == NEW:
                rows = cfg["prompt_tokens"] - 1
                h = receive(rows) if rows else torch.empty(0, spec.hidden, dtype=torch.bfloat16)
                waited += hidden_exec.meter.records[-1].seconds if rows else 0.0
                t0 = time.perf_counter()
                model.prefill_part(s, part, h)
                t_prefill.append(time.perf_counter() - t0)
                waited += t_prefill[-1]
                targets[s], done[s] = targets_for(cfg, rid, spec.vocab_size), 0
            slots.append(s)
        h = receive(len(slots))
        waited += hidden_exec.meter.records[-1].seconds
        t0 = time.perf_counter()
        logits = model.step_part(slots, part, h).to(torch.bfloat16)
        t1 = time.perf_counter()
        plan, contract = result_plans.get(len(slots))
        ids = torch.tensor([targets[s][done[s]] for s in slots]) if req == "logprob" else None
        result_exec.run(plan, contract, {0: {}, 1: {"logits": logits}}, ids)
        critical.append(_last_call(result_exec)[0] - start - waited)
        planned["startups"] += plan.startups
        planned["payload_bytes"] += plan.payload_bytes
        t_forward.append(t1 - t0)
        t_project.append(time.perf_counter() - t1)
        for s in slots:
            done[s] += 1
    return {
        "critical_s": mean_of(critical),
        "records": [r.to_dict() for r in result_exec.meter.records],
        "hidden_records": [r.to_dict() for r in hidden_exec.meter.records],
        "steps": len(t_forward),
        "meter_t0": {"result": result_exec.meter.t0, "hidden": hidden_exec.meter.t0},
        "forward_s": mean_of(t_forward),
        "project_s": mean_of(t_project),
        "prefill_s": mean_of(t_prefill),
        "planned": planned,
    }


# -- the single-process reference ---------------------------------------------------------------
@dataclass(frozen=True)
class OutputCheck:
    """The live run's outputs against the single-process reference of the same split model."""

    tokens: int  # chosen ids compared (or log-probs, for logprob)
    identical: bool
    first_difference: str | None  # which request and position departed first, with both values

    def to_dict(self) -> JsonObject:
        return {"tokens": self.tokens, "identical": self.identical, "first_difference": self.first_difference}


def reference(
    cfg: Mapping[str, Any], schedule: Sequence[Mapping[str, Any]]
) -> tuple[dict[int, list[int]], dict[int, list[float]]]:
    """Replay ``schedule`` in this process with the same two parts (no link): every request's
    chosen ids and, for ``logprob``, its log-probabilities. One thread, as the hosts run."""
    import torch

    from ..plans.ops import reference_logprob

    first, a = part_model(cfg, 0)  # the same builders (and, with --compile aoti, the same packages)
    last, b = part_model(cfg, 1)
    spec = a.spec
    req = cfg["request"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rid_of: dict[int, int] = {}
        token: dict[int, int] = {}
        targets: dict[int, list[int]] = {}
        outputs: dict[int, list[int]] = {}
        logprobs: dict[int, list[float]] = {}
        for entry in schedule:
            for s, rid in entry["new"]:
                prompt = prompt_for(cfg, rid, spec.vocab_size)
                h = a.prefill_part(s, first, torch.tensor(prompt))
                b.prefill_part(s, last, h if h is not None else torch.empty(0, spec.hidden, dtype=torch.bfloat16))
                rid_of[s], token[s] = rid, prompt[-1]
                targets[rid], outputs[rid], logprobs[rid] = targets_for(cfg, rid, spec.vocab_size), [], []
            batch = list(entry["batch"])
            with torch.no_grad():
                logits = b.step_part(batch, last, a.step_part(batch, first, torch.tensor([token[s] for s in batch])))
            logits = logits.to(torch.bfloat16)
            if req == "logprob":
                ids = torch.tensor([targets[rid_of[s]][len(outputs[rid_of[s]])] for s in batch])
                lp = reference_logprob(logits, ids)
                chosen = [int(x) for x in ids]
                for j, s in enumerate(batch):
                    logprobs[rid_of[s]].append(float(lp[j]))
            else:
                chosen = [int(x) for x in logits.argmax(dim=-1)]
            for j, s in enumerate(batch):
                outputs[rid_of[s]].append(chosen[j])
                token[s] = chosen[j]
    finally:
        torch.set_num_threads(threads)
    return outputs, logprobs


def compare(
    cfg: Mapping[str, Any],
    schedule: Sequence[Mapping[str, Any]],
    outputs: Mapping[int, Sequence[int]],
    logprobs: Mapping[int, Sequence[float]],
) -> OutputCheck:
    """Exact comparison of the live outputs with :func:`reference` (ids, and log-probs bit for bit:
    both sides compute them from identical bfloat16 logits with the same function)."""
    ref_out, ref_lp = reference(cfg, schedule)
    count = 0
    if set(ref_out) != set(outputs):
        return OutputCheck(0, False, f"requests differ: live {sorted(outputs)}, reference {sorted(ref_out)}")
    for rid in sorted(ref_out):
        live, ref = list(outputs[rid]), ref_out[rid]
        if len(live) != len(ref):
            return OutputCheck(count, False, f"request {rid}: {len(live)} tokens live, {len(ref)} in the reference")
        for k, (x, y) in enumerate(zip(live, ref)):
            if x != y:
                return OutputCheck(count, False, f"request {rid} token {k}: live {x}, reference {y}")
            if cfg["request"] == "logprob" and logprobs[rid][k] != ref_lp[rid][k]:
                return OutputCheck(
                    count, False, f"request {rid} log-prob {k}: live {logprobs[rid][k]!r}, reference {ref_lp[rid][k]!r}"
                )
            count += 1
    return OutputCheck(count, True, None)
