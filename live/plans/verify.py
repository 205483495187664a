"""Verification of a live run against the single-process reference, under the contract's equivalence.

For each consumer rank, the reference observation is computed in one process from the
reference producer tensor (:func:`meshpact.live.plans.workloads.reference_producer`): the whole
logits (``full``), the argmax per row (``token``), ``log_softmax`` in float32 read at the
requested ids (``logprob``, :func:`meshpact.live.plans.ops.reference_logprob`, the
interpreter's formula), the owner's rows only (``owner_token``), or the consumer's chunk of
the completed MLP output (``mlp``). What the rank delivered must match it in shape and dtype,
and in value either bit for bit (``torch.equal``) where the contract's equivalence is bitwise,
or within the contract's stated tolerance where it allows a substitute.

Owner scope is checked on everything a consumer rank ever held, not only on what it
delivered (:func:`owner_scope_leaks`): a non-owner's buffers must never hold a row that
another rank owns.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch

from meshpact.core.contract import Contract
from meshpact.core.contract import Equivalence as ContractEquivalence
from meshpact.core.facts import Edge
from meshpact.core.jsonform import JsonObject

from .ops import chunk, reference_logprob
from .workloads import LiveRequest, get_preset, logprob_ids, reference_producer

__all__ = ["Equivalence", "equivalence_of", "reference_observation", "owner_scope_leaks", "Verdict", "verify_job"]


@dataclass(frozen=True)
class Equivalence:
    """``bitwise``, or a tolerance ``|a - b| <= atol + rtol * |b|``."""

    bitwise: bool
    atol: float = 0.0
    rtol: float = 0.0

    def describe(self) -> str:
        return "bitwise" if self.bitwise else f"tolerance(atol={self.atol:g}, rtol={self.rtol:g})"


def equivalence_of(contract: Contract) -> Equivalence:
    """The equivalence the contract's substitutability facet states for the observation."""
    sub = contract.substitutability
    if sub.equivalence is ContractEquivalence.BITWISE or sub.tolerance is None:
        return Equivalence(True)
    return Equivalence(False, sub.tolerance.atol, sub.tolerance.rtol)


def reference_observation(request: LiveRequest, preset: str, edge: Edge, rank: int) -> torch.Tensor:
    """What consumer ``rank`` must observe, computed in this one process."""
    parts = edge.mesh.domain(edge.producer.domain).size
    full = reference_producer(request.value, preset, parts)
    cons = edge.consumer
    if request is LiveRequest.FULL:
        return full
    if request is LiveRequest.TOKEN:
        return torch.argmax(full, dim=-1)
    if request is LiveRequest.LOGPROB:
        return reference_logprob(full, torch.tensor(logprob_ids(get_preset(preset)), dtype=torch.int64))
    if request is LiveRequest.OWNER_TOKEN:
        rows = [r for r, o in enumerate(cons.owners or ()) if o == rank]
        return torch.argmax(full, dim=-1)[rows]
    return chunk(full, cons.shard_dim or 0, len(cons.ranks), cons.ranks.index(rank))


def owner_scope_leaks(
    request: LiveRequest, preset: str, edge: Edge, history: Mapping[int, Sequence[tuple[int, str, Any]]]
) -> list[str]:
    """Buffers on a consumer rank that hold results of rows another rank owns.

    A consumer rank may hold, at any step, at most its own rows, and any token buffer it holds
    must be exactly its own rows' tokens (a buffer with another owner's token in it, or more
    rows than the rank owns, is a leak). Empty for requests without owner scope.
    """
    if request is not LiveRequest.OWNER_TOKEN:
        return []
    owners = edge.consumer.owners or ()
    leaks: list[str] = []
    for rank in edge.consumer.ranks:
        own = reference_observation(request, preset, edge, rank)
        for step, name, value in history.get(rank, ()):
            for t in value if isinstance(value, (list, tuple)) else [value]:
                rows = t.shape[0] if t.dim() else 1
                if rows > len(own):
                    leaks.append(f"rank {rank} step {step} buffer {name!r}: holds {rows} rows, owns {len(own)}")
                elif not t.is_floating_point() and not torch.equal(t.reshape(-1).cpu(), own[:rows].reshape(-1)):
                    leaks.append(
                        f"rank {rank} step {step} buffer {name!r}: token ids {t.tolist()} are not its own rows' "
                        f"{own.tolist()} (rows owned: {[r for r, o in enumerate(owners) if o == rank]})"
                    )
    return leaks


@dataclass(frozen=True)
class Verdict:
    ok: bool
    equivalence: str
    per_rank: Mapping[int, str] = field(default_factory=dict)
    max_abs_error: float = 0.0
    leaks: tuple[str, ...] = ()

    def to_dict(self) -> JsonObject:
        return {
            "ok": self.ok,
            "equivalence": self.equivalence,
            "per_rank": {str(k): v for k, v in self.per_rank.items()},
            "max_abs_error": self.max_abs_error,
            "owner_scope_leaks": list(self.leaks),
        }


def _compare(got: Any, want: torch.Tensor, eq: Equivalence) -> tuple[bool, str, float]:
    if not isinstance(got, torch.Tensor):
        return False, f"delivered {type(got).__name__}, expected a tensor", float("inf")
    if tuple(got.shape) != tuple(want.shape) or got.dtype != want.dtype:
        return False, f"delivered {got.dtype} {list(got.shape)}, expected {want.dtype} {list(want.shape)}", float("inf")
    if got.numel() == 0:
        return True, "nothing to observe, nothing delivered", 0.0
    err = float((got.double() - want.double()).abs().max())
    if eq.bitwise or not want.is_floating_point():
        same = torch.equal(
            got.view(torch.uint8) if got.is_floating_point() else got,
            want.view(torch.uint8) if want.is_floating_point() else want,
        )
        return same, "bitwise equal" if same else f"not bitwise equal (max |error| {err:.3g})", err
    ok = bool(torch.allclose(got.double(), want.double(), atol=eq.atol, rtol=eq.rtol))
    return (
        ok,
        f"within {eq.describe()} (max |error| {err:.3g})" if ok else f"outside {eq.describe()} (max |error| {err:.3g})",
        err,
    )


def verify_job(
    request: LiveRequest, preset: str, edge: Edge, contract: Contract, per_rank: Mapping[int, Mapping[str, Any]]
) -> Verdict:
    """Judge one job from every rank's deliveries and buffer history."""
    eq = equivalence_of(contract)
    details: dict[int, str] = {}
    ok, worst = True, 0.0
    for rank in edge.consumer.ranks:
        delivered = per_rank[rank].get("delivered") or {}
        want = reference_observation(request, preset, edge, rank)
        if len(delivered) > 1:
            good, why, err = False, f"{len(delivered)} deliveries {sorted(delivered)}, expected one", float("inf")
        elif not delivered:
            good, why, err = (want.numel() == 0), "nothing delivered", 0.0 if want.numel() == 0 else float("inf")
        else:
            good, why, err = _compare(next(iter(delivered.values())), want, eq)
        details[rank] = why
        ok &= good
        worst = max(worst, err)
    for rank, job in per_rank.items():
        if rank not in edge.consumer.ranks and job.get("delivered"):
            details[rank] = f"delivered {sorted(job['delivered'])} but is not a consumer rank"
            ok = False
    leaks = owner_scope_leaks(request, preset, edge, {r: j.get("history", ()) for r, j in per_rank.items()})
    return Verdict(ok and not leaks, eq.describe(), details, worst, tuple(leaks))
