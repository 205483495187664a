"""``meshpact live bridge``: run one request's plan across two native domains of real ranks.

Starts 2 + 2 ranks (``--ranks-per-domain``) on loopback (gloo on CPU standing in for each vendor's runtime unless
capability detection finds it), runs the lowerer's checked plan for the request, verifies
what every consumer rank observed against a single-process reference under the contract's
equivalence, and compares measured startups and payload bytes with the plan's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import typer

from meshpact.commands._common import console, emit_json, table
from meshpact.core.errors import MeshpactError
from meshpact.live.plans.jobs import LiveRequest, PresetName  # torch-free: keeps --help instant

__all__ = ["register"]


def bridge(
    request: LiveRequest = typer.Option(..., "--request", help="What the consumer domain reads."),
    preset: PresetName = typer.Option(
        PresetName("tiny"), "--preset", help="Sizes: tiny, or Qwen3-14B's real dimensions."
    ),
    record: Optional[Path] = typer.Option(
        None, "--record", help="JSONL recording path [default: recordings/bridge-<request>-<preset>.jsonl]"
    ),
    per_domain: int = typer.Option(2, "--ranks-per-domain", min=1, max=8, help="Ranks in each of the two domains."),
    timeout_s: float = typer.Option(600.0, "--timeout", min=10.0, help="Seconds before every rank is stopped."),
    as_json: bool = typer.Option(False, "--json", help="One JSON document on stdout."),
) -> None:
    """Run a checked plan across two native domains (2 + 2 ranks by default), verified and metered."""
    from meshpact.live.plans.bridge import Job, job_summary, run_bridge

    path = record or Path("recordings") / f"bridge-{request.value}-{preset.value}.jsonl"
    report = run_bridge([Job(request)], preset.value, per_domain=per_domain, recording=path, timeout_s=timeout_s)
    job = report["jobs"][0]
    if job.get("refused"):
        raise MeshpactError("the executor refused the plan: " + "; ".join(job["refused"]))
    summary = job_summary(report, job)
    if as_json:
        emit_json(summary)
    else:
        _print(report, job, summary)
    if not (summary["verified"] and job["cost_matches"]):
        raise typer.Exit(1)


def _print(report: dict[str, Any], job: dict[str, Any], summary: dict[str, Any]) -> None:
    ver = job["verification"]
    console.print(
        table(
            f"live bridge: {job['request']} on {report['preset']} ({' -> '.join(report['mesh'])})",
            ["", "planned", "measured"],
            [
                ["startups", summary["startups"]["planned"], summary["startups"]["measured"]],
                ["payload bytes", summary["payload_bytes"]["planned"], summary["payload_bytes"]["measured"]],
                *[
                    [f"  bytes on {link}", job["planned"]["bytes_by_link"].get(link, 0), n]
                    for link, n in job["measured"]["bytes_by_link"].items()
                ],
            ],
        )
    )
    console.print(
        table(
            "plan",
            ["#", "step", "ranks", "bytes", "link"],
            [
                [i, f"{s['kind']} {s['op']}", s["ranks"], s["payload_bytes"], s["link"] or ""]
                for i, s in enumerate(job["plan"]["steps"])
            ],
        )
    )
    console.print(
        table(
            "ranks",
            ["rank", "domain", "backend", "device", "observed"],
            [
                [
                    lay["rank"],
                    lay["domain"],
                    lay["backend"] + (" (stand-in)" if lay["stand_in"] else ""),
                    lay["device"],
                    ver["per_rank"].get(str(lay["rank"]), "-"),
                ]
                for lay in report["layouts"]
            ],
        )
    )
    verdict = "verified" if summary["verified"] else "NOT verified"
    cost = "planned == measured" if job["cost_matches"] else "planned != measured"
    console.print(f"{verdict} under {summary['equivalence']}; {cost}; recording: {summary['recording']}")
    for leak in ver.get("owner_scope_leaks", []):
        console.print(f"owner scope leak: {leak}")


def register(groups: Any) -> None:
    groups.live.command("bridge")(bridge)
