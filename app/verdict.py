"""Verdict of a finished live run: what its final state was compared with, in one sentence.

A live trial compares the faulted run's final state with a reference. Which reference
depends on what the run did: a run that kept every rank (in-memory rebind, peer restore) is
compared bit for bit with the fault-free run; a run that excised a rank cannot equal the
fault-free run (the survivors train the same global batch on fewer ranks, so sums are taken in
another order), and is compared bit for bit with the *excising reference*, a fault-free run
that drops the same ranks at the same steps, and measured against the fault-free run by its
largest absolute difference. :func:`run_verdict` reads the run's JSON summary (the document
``meshpact live recover --json`` prints) and names the reference it was judged against, so the
page never claims an equality the run did not check. :func:`downtime_notes` says, for each
downtime figure, what it includes, and why a figure the user asked for is absent.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any, Mapping

from meshpact.core.recovery import Policy

__all__ = ["Tone", "Verdict", "run_verdict", "downtime_notes"]


class Tone(str, Enum):
    """How the page draws a verdict."""

    SUCCESS = "success"
    ERROR = "error"


@dataclass(frozen=True)
class Verdict:
    """A finished run's verdict: its tone and its sentence (Markdown)."""

    tone: Tone
    text: str


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)


def _faults(summary: Mapping[str, Any]) -> str:
    total, by_page = summary.get("faults_injected"), summary.get("faults_from_page", 0)
    return f"{total} fault(s)" + (f", {by_page} of them sent from this page" if by_page else "")


def run_verdict(summary: Mapping[str, Any]) -> Verdict:
    """The verdict of a run from its JSON summary: the reference it was compared with, and the
    result of that comparison (an excised run also its largest difference from the fault-free run)."""
    faults = _faults(summary)
    excision = summary.get("excision")
    if not excision:
        if summary.get("bit_identical"):
            return Verdict(
                Tone.SUCCESS,
                f"**Bit-identical to the fault-free reference:** after {faults}, every "
                "rank's parameters and optimizer state equal the fault-free run's.",
            )
        return Verdict(
            Tone.ERROR,
            f"**Not bit-identical to the fault-free reference** after {faults}: "
            + "; ".join(summary.get("mismatches") or ["states differ"]),
        )
    plan = [(int(e["step"]), sorted(int(r) for r in e["lost"])) for e in excision.get("excisions") or ()]
    went = "; ".join(f"without {_ranks(lost)} from step {step}" for step, lost in plan) or "with every rank"
    diff = excision.get("max_abs_diff_from_unfailed")
    against = (
        "Against the fault-free run, which kept every rank, it differs by at most "
        f"{float(diff):.3g} (largest absolute difference of any parameter or optimizer value): an excised "
        "run trains on fewer ranks and cannot equal it."
        if diff is not None
        else "It was not compared with the fault-free run."
    )
    if excision.get("refused"):
        return Verdict(
            Tone.ERROR,
            f"**Excision refused** after {faults}: {excision['refused']}. "
            + (
                f"The state was flushed to `{excision['flushed_checkpoint']}`."
                if excision.get("flushed_checkpoint")
                else ""
            ),
        )
    if excision.get("equal_to_excising_reference"):
        return Verdict(
            Tone.SUCCESS,
            f"**Bit-identical to the excising reference:** after {faults}, every "
            "surviving rank's parameters and optimizer state equal a fault-free run that "
            f"went on {went}. {against}",
        )
    return Verdict(
        Tone.ERROR,
        f"**Not equal to the excising reference** (a fault-free run that went on {went}) "
        f"after {faults}: " + "; ".join(summary.get("mismatches") or ["states differ"]) + f". {against}",
    )


def downtime_notes(summary: Mapping[str, Any], baselines_asked: bool) -> list[str]:
    """One line per downtime figure of the summary saying what it includes, then a line for the
    figures not measured: why, where the run says so (an excising run measures no checkpoint
    baseline: it loses a rank for good, which a checkpoint restore would bring back)."""
    down = summary.get("downtime_s") or {}
    includes = summary.get("downtime_includes") or {}
    out = [
        f"**{Policy(p).label}** includes {includes[p]}." for p, s in down.items() if s is not None and includes.get(p)
    ]
    missing = [Policy(p).label for p, s in down.items() if s is None]
    if missing:
        why = ""
        if summary.get("excision") and baselines_asked:
            why = (
                " An excising run measures no checkpoint baseline: its survivors go on without the lost rank, "
                "while a checkpoint restore or a cold restart brings it back, so the figures would not compare "
                "like with like."
            )
        out.append("Not measured in this run: " + ", ".join(missing) + "." + why)
    return out
