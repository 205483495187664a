"""``meshpact live recover``: inject communication faults into sharded training and recover in memory.

Runs a fault-free reference and a faulted run of a workload (``--workload``: a shipped one by
name, or the user's own file defining ``build``, ``batch`` and ``train_step``) on real ranks,
then a checkpoint restore in the job and a cold restart for comparison; checks every rank's
parameters, optimizer state and generators against the reference with ``torch.equal`` and
prints the stage table (or, with ``--json``, one JSON document).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, TypedDict

import typer

from meshpact.commands._common import console, emit_json, table
from meshpact.live.recovery.faults import FaultKind  # torch-free: keeps --help instant
from meshpact.live.trials.trialconfig import OnRankLoss  # torch-free

__all__ = ["register", "json_view", "JSON_KEYS"]


def recover(
    ranks: int = typer.Option(4, "--ranks", min=2, max=16, help="Ranks (processes) to start."),
    steps: int = typer.Option(40, "--steps", min=2, help="Training steps."),
    faults: int = typer.Option(10, "--faults", min=0, help="Faults to inject, at distinct steps."),
    fault_kind: FaultKind = typer.Option(FaultKind.COLLECTIVE, "--fault-kind", help="How the fault is injected."),
    checkpoint_every: Optional[int] = typer.Option(
        None,
        "--checkpoint-every",
        min=1,
        help="Checkpoint interval K (steps) [default: 10, or --steps when that is fewer].",
    ),
    data_timeout: Optional[float] = typer.Option(
        None,
        "--data-timeout",
        min=0.1,
        help="Data-path timeout "
        "(seconds) [default: follow the job: the warm-up bound for the "
        "first step, then 4 x the longest step, at least 1 s].",
    ),
    record: Optional[Path] = typer.Option(
        None, "--record", help="JSONL recording path [default: recordings/recover-<kind>-<ranks>r.jsonl]"
    ),
    baselines: bool = typer.Option(
        True, "--baselines/--no-baselines", help="Also measure checkpoint restore and cold restart."
    ),
    timeout_s: Optional[float] = typer.Option(
        None,
        "--timeout",
        min=1.0,
        help="Seconds before every rank is "
        "stopped [default: derived from the recovery timeouts, steps and "
        "faults; never below the rank-loss bound].",
    ),
    workload: str = typer.Option(
        "decoder",
        "--workload",
        help="A workload file (build, batch, train_step, "
        "optional MESH) or a shipped one: decoder, llama_hsdp, compiled.",
    ),
    heartbeat: bool = typer.Option(
        True,
        "--heartbeat/--no-heartbeat",
        help="Find stalled ranks by a heartbeat on "
        "the control channel, not only by the data-path timeout (on by default).",
    ),
    peer_copies: int = typer.Option(
        1,
        "--peer-copies",
        min=0,
        help="K: ranks holding each rank's committed state "
        "in host memory, so a lost rank's replacement takes it from a peer instead "
        "of storage (0: none; at most ranks - 1).",
    ),
    peer_copy_depth: int = typer.Option(
        2,
        "--peer-copy-depth",
        min=1,
        max=2,
        help="Committed steps each holder "
        "keeps of a rank's copy, and each rank of its own snapshots: 2 rolls back "
        "one step in memory when a rank dies with its newest copy in flight; 1 "
        "takes half the host memory and restores from the checkpoint then.",
    ),
    on_rank_loss: OnRankLoss = typer.Option(
        OnRankLoss.REPLACE,
        "--on-rank-loss",
        help="A killed rank: replace (a new process or "
        "a warm spare takes its state from a peer) or excise (the survivors re-shard "
        "its state from the peer copy and go on, same global batch).",
    ),
    min_ranks: int = typer.Option(
        1,
        "--min-ranks",
        min=1,
        help="Excising: stop, with the state flushed to a checkpoint, rather than go on with fewer ranks than this.",
    ),
    spare_ranks: int = typer.Option(
        0,
        "--spare-ranks",
        min=0,
        help="Warm spare processes started with the "
        "ranks, waiting idle (imports done); a lost rank is handed to one instead of "
        "a new process.",
    ),
    as_json: bool = typer.Option(False, "--json", help="One JSON document on stdout."),
) -> None:
    """Inject faults into FSDP2 training on real ranks and recover in memory."""
    from meshpact.live.trials.trial import run_trial
    from meshpact.live.trials.trialconfig import TrialConfig

    cfg = TrialConfig(
        ranks=ranks,
        steps=steps,
        faults=faults,
        fault_kind=fault_kind,
        checkpoint_every=min(10, steps) if checkpoint_every is None else checkpoint_every,
        data_timeout_s=data_timeout,
        baselines=baselines,
        **_fault_lengths(data_timeout),
        timeout_s=timeout_s,
        workload=workload,
        heartbeat=heartbeat,
        peer_copies=peer_copies,
        peer_copy_depth=peer_copy_depth,
        spare_ranks=spare_ranks,
        on_rank_loss=on_rank_loss.value,
        min_ranks=min_ranks,
    )
    path = record or Path("recordings") / f"recover-{fault_kind.value}-{ranks}r.jsonl"
    result = run_trial(cfg, recording_path=path)
    summary = result.summary()
    out = json_view(summary)
    if as_json:
        emit_json(out)
    else:
        _print(result, summary)
    refused = (summary["excision"] or {}).get("refused")
    if refused:  # below --min-ranks: stopped on purpose, nothing lost (the state is in the named checkpoint)
        if not as_json:
            console.print(refused)
        raise typer.Exit(0 if summary["bit_identical"] else 1)
    if not summary["bit_identical"] or summary["faults_recovered"] != summary["faults_injected"]:
        raise typer.Exit(1)


class _FaultLengths(TypedDict, total=False):
    stall_s: float
    down_s: float


def _fault_lengths(data_timeout: float | None) -> _FaultLengths:
    """A stall and a partition that outlast a set data-path timeout (the trial's own lengths,
    past the heartbeat's bound, when the timeout follows the job)."""
    if data_timeout is None:
        return {}
    return {"stall_s": data_timeout + 0.5, "down_s": 2.0 * data_timeout}


JSON_KEYS = (
    "ranks",
    "steps",
    "fault_kind",
    "faults_injected",
    "faults_recovered",
    "bit_identical",
    "policy_counts",
    "rebind_ms",
    "downtime_s",
    "downtime_includes",
    "storage_bytes_read",
    "final_world_size",
    "peer_copy_overhead",
    "excision",
    "recording",
)


def json_view(summary: dict[str, Any]) -> dict[str, Any]:
    """The ``--json`` document: exactly these keys, in this order."""
    return {k: summary[k] for k in JSON_KEYS}


def _ms(x: Any) -> str:
    return "-" if x is None else f"{x * 1e3:.1f}"


def _print(result: Any, summary: dict[str, Any]) -> None:
    from meshpact.core.recovery import Stage

    stages = [s for s in Stage.ordered() if s is not Stage.RESTART]
    rows = []
    for r in result.recoveries():
        rows.append(
            [
                r["step"],
                r["generation"],
                r["policy"],
                *[_ms(r["stages_s"].get(s.value)) for s in stages],
                _ms(r["downtime_s"]),
            ]
        )
    console.print(
        table(
            f"Recoveries ({summary['fault_kind']}, {summary['ranks']} ranks, ms)",
            ["step", "gen", "policy", *[s.value for s in stages], "downtime"],
            rows,
        )
    )
    down = summary["downtime_s"]
    console.print(
        table(
            "Downtime per fault (s)",
            ["in memory", "peer restore", "excise", "checkpoint restore", "cold restart"],
            [
                [
                    *(
                        ("-" if down[k] is None else f"{down[k]:.3f}")
                        for k in ("in_memory", "peer_restore", "excise", "checkpoint_restore", "cold_restart")
                    )
                ]
            ],
        )
    )
    includes = summary["downtime_includes"]
    console.print(
        table(
            "What each downtime includes",
            ["policy", "includes"],
            [[k.replace("_", " "), v] for k, v in includes.items() if v is not None],
        )
    )
    exc = summary["excision"]
    if exc is not None:
        diff = exc["max_abs_diff_from_unfailed"]
        console.print(
            f"excisions {[(e['step'], e['lost']) for e in exc['excisions']]}; final world "
            f"{summary['final_world_size']} rank(s); bitwise equal to the excising reference: "
            f"{'yes' if exc['equal_to_excising_reference'] else 'NO'}; max |difference| from the "
            f"never-failed run: {'-' if diff is None else f'{diff:.3g}'}"
        )
    peer = summary["peer_copy_overhead"]
    if peer is not None:
        lat = "-" if peer["step_latency"] is None else f"{peer['step_latency'] * 100:+.1f} %"
        console.print(
            f"peer copies (K={peer['copies']}): step latency {lat}, host memory per rank "
            f"{peer['host_bytes_per_rank'] / 2**20:.2f} MiB, network {peer['network_bytes_per_hour'] / 2**30:.2f}"
            f" GiB/h; storage read by recoveries: {summary['storage_bytes_read']} bytes"
        )
    ok = "[green]yes[/green]" if summary["bit_identical"] else "[red]NO[/red]"
    # an excising run is judged against the run in which its ranks left at that step without a fault
    against = "the excising reference" if exc is not None else "the fault-free run"
    console.print(
        f"faults injected {summary['faults_injected']}, recovered {summary['faults_recovered']}; "
        f"bit-identical to {against}: {ok}; operations on retired groups after rebind: "
        f"{summary['old_group_ops_after_rebind']}; replacement processes: "
        f"{summary['replacement_processes']}"
    )
    for m in summary["mismatches"]:
        console.print(f"  [red]{m}[/red]")
    console.print(f"recording: {summary['recording']}")


def register(groups: Any) -> None:
    groups.live.command("recover")(recover)
