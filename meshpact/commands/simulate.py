"""``meshpact simulate training|serving|sweep``: the SimPy simulator from the command line."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import typer

from meshpact.core.errors import MeshpactError
from meshpact.core.facts import Request
from meshpact.core.scenario import CheckpointMode, Deployment
from meshpact.simulator.sweep import SweepKind
from meshpact.commands._common import console, emit_json, err_console, table

__all__ = ["register"]


def _scenario(value: str) -> Any:
    """A scenario file path, or the name of a built-in scenario."""
    from meshpact.core.scenario import builtin_scenario_path, load_scenario

    p = Path(value)
    if p.suffix in (".yaml", ".yml") or p.exists():
        return load_scenario(p)
    return load_scenario(builtin_scenario_path(value))


def _policies(value: str) -> list[str] | None:
    from meshpact.core.recovery import Policy

    if value == "all":
        return None
    names = [v.strip() for v in value.split(",") if v.strip()]
    known = [p.value for p in Policy]
    bad = [n for n in names if n not in known]
    if bad or not names:
        raise MeshpactError(f"--policy {value!r}: expected 'all' or one or more of {', '.join(known)}")
    return names


def training(
    scenario: Optional[str] = typer.Option(
        None,
        "--scenario",
        help="Scenario file or built-in name (default: default; airesim_table1 with --from-airesim).",
    ),
    ranks: Optional[int] = typer.Option(None, "--ranks", help="Ranks simulated."),
    days: Optional[float] = typer.Option(None, "--days", help="Wall-clock days."),
    step_seconds: Optional[float] = typer.Option(
        None, "--step-seconds", help="Seconds per step (replaces the cost model)."
    ),
    rank_mtbf_hours: Optional[float] = typer.Option(
        None, "--rank-mtbf-hours", help="Per-rank MTBF of transient faults."
    ),
    checkpoint_every: Optional[int] = typer.Option(None, "--checkpoint-every", help="Steps between checkpoints."),
    checkpoint_seconds: Optional[float] = typer.Option(
        None, "--checkpoint-seconds", help="Seconds to write one checkpoint."
    ),
    checkpoint_mode: Optional[CheckpointMode] = typer.Option(None, "--checkpoint-mode", help="sync or async."),
    policy: str = typer.Option("all", "--policy", help="A policy, a comma list, or all."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Seed of the fault trace."),
    work_steps: Optional[int] = typer.Option(None, "--work-steps", help="Fixed work: run until N steps are committed."),
    calibrate_from: Optional[Path] = typer.Option(
        None,
        "--calibrate-from",
        help="Live recording (JSONL) with stage durations; a fresh `meshpact live recover` "
        "recording is also replayed and predicted against what it measured.",
    ),
    as_json: bool = typer.Option(False, "--json", help="One JSON document on stdout."),
    trace: Optional[Path] = typer.Option(None, "--trace", help="Write a Chrome trace (Perfetto) here."),
    from_airesim: Optional[Path] = typer.Option(
        None,
        "--from-airesim",
        help="An AIReSim parameter file (YAML or JSON, AIReSim's names): run its cluster as the scenario's fleet.",
    ),
    tolerance: float = typer.Option(
        0.01,
        "--tolerance",
        help="Fleet runs: replicate until the 95 % interval of the "
        "time to finish and of the effective training ratio is within this fraction of the mean.",
    ),
    max_replications: int = typer.Option(200, "--max-replications", help="Fleet runs: at most this many replications."),
) -> None:
    """Training with faults: every policy on the same fault trace; or, on a fleet of servers
    (a scenario's fleet section or --from-airesim), every policy replicated to an interval."""
    step_flags = {
        "--ranks": ranks,
        "--days": days,
        "--step-seconds": step_seconds,
        "--rank-mtbf-hours": rank_mtbf_hours,
        "--checkpoint-every": checkpoint_every,
        "--checkpoint-seconds": checkpoint_seconds,
        "--checkpoint-mode": checkpoint_mode,
        "--work-steps": work_steps,
        "--trace": trace,
    }
    sc_name = scenario or ("airesim_table1" if from_airesim else "default")
    if from_airesim is not None or (scenario is not None and _scenario(sc_name).fleet is not None):
        used = [k for k, v in step_flags.items() if v is not None]
        if used:
            raise MeshpactError(
                f"{used[0]}: does not apply to a fleet run (a scenario with a fleet section or "
                "--from-airesim); set the fleet's fields instead"
            )
        _fleet(sc_name, from_airesim, policy, seed, calibrate_from, tolerance, max_replications, as_json)
        return
    scenario = sc_name
    from meshpact.core.errors import RecordingError
    from meshpact.simulator.calibrate import calibration_from_recording
    from meshpact.simulator.replay import replay_live
    from meshpact.simulator.timeline import check_trace_path, write_chrome_trace
    from meshpact.simulator.training import simulate_training

    if trace:
        check_trace_path(trace)
    sc = _scenario(scenario)
    cal = calibration_from_recording(calibrate_from, sc.recovery.recovery_costs()) if calibrate_from else None
    replay, no_replay = None, None
    if calibrate_from:
        try:  # the recorded run itself, replayed: predicted against measured
            replay = replay_live(calibrate_from)
        except RecordingError as exc:
            no_replay = str(exc)
    result = simulate_training(
        sc,
        ranks=ranks,
        days=days,
        step_seconds=step_seconds,
        rank_mtbf_hours=rank_mtbf_hours,
        checkpoint_every=checkpoint_every,
        checkpoint_seconds=checkpoint_seconds,
        checkpoint_mode=checkpoint_mode.value if checkpoint_mode else None,
        policies=_policies(policy),
        seed=seed,
        work_steps=work_steps,
        adjust=cal.adjust if cal else None,
        timeline=trace is not None,
    )
    if trace:
        write_chrome_trace(result, trace)
    if as_json:
        doc = result.to_dict()
        if cal:
            doc["calibration"] = cal.to_dict()
            doc["live_replay"] = replay.to_dict() if replay else {"unavailable": no_replay}
        emit_json(doc)
        return
    w = result.workload
    console.print(
        f"{result.scenario}: {w.ranks} ranks, {result.horizon_s / 86400:g} days, step {w.step_s:.3g} s, "
        f"checkpoint every {w.checkpoint_every} steps ({w.checkpoint_mode.value}), "
        f"{len(result.trace)} faults in the trace"
    )
    from meshpact.core.recovery import Stage

    pols = list(result.policies.values())
    rows: list[list[Any]] = [["goodput", *[f"{r.goodput:.4f}" for r in pols]]]
    if w.work_steps is not None:
        rows.append(
            [
                f"time to {w.work_steps} steps (h)",
                *["not done" if r.time_to_finish_s is None else f"{r.time_to_finish_s / 3600:.3f}" for r in pols],
            ]
        )
    rows += [["faults", *[r.faults for r in pols]], ["lost steps", *[r.lost_steps for r in pols]]]
    rows += [[f"{s.value} (s)", *[f"{r.downtime_s.get(s, 0.0):.1f}" for r in pols]] for s in Stage.ordered()]
    rows += [
        ["degraded (s)", *[f"{r.degraded_s:.1f}" for r in pols]],
        ["checkpoint overhead", *[f"{r.checkpoint_fraction:.4f}" for r in pols]],
        ["peer copy (s per step)", *[f"{r.peer_copy_s_per_step:.3g}" for r in pols]],
        ["spares used / scheduler", *[f"{r.spares_used} / {r.scheduler_replacements}" for r in pols]],
    ]
    console.print(table("per policy, same fault trace", ["", *[r.policy.value for r in pols]], rows))
    if cal:
        _print_calibration(cal)
    if replay:
        _print_replay(replay)
    elif no_replay:
        console.print(f"no live replay: {no_replay}")
    if trace:
        console.print(f"trace: {trace} (open in https://ui.perfetto.dev)")


def _fleet(
    scenario: str,
    from_airesim: Path | None,
    policy: str,
    seed: int | None,
    calibrate_from: Path | None,
    tolerance: float,
    max_replications: int,
    as_json: bool,
) -> None:
    """A fleet run: every policy replicated until its interval is within ``tolerance``."""
    from meshpact.core.fleet import fleet_from_airesim
    from meshpact.simulator.calibrate import calibration_from_recording
    from meshpact.simulator.fleet import MAX_REPLICATIONS, simulate_fleet

    if not 0 < tolerance < 1:
        raise MeshpactError(f"--tolerance {tolerance}: expected a fraction of the mean in (0, 1), e.g. 0.01")
    if not 5 <= max_replications <= MAX_REPLICATIONS:
        raise MeshpactError(f"--max-replications {max_replications}: expected 5..{MAX_REPLICATIONS}")
    fleet = fleet_from_airesim(from_airesim) if from_airesim else None
    sc = _scenario(scenario)
    cal = calibration_from_recording(calibrate_from, sc.recovery.recovery_costs()) if calibrate_from else None
    with_progress = not as_json

    def progress(p: Any, n: int, r: Any) -> None:
        if with_progress:
            err_console.print(
                f"{p.value}: {n} replications, time to finish {r.finish_h.mean:,.0f} h "
                f"± {r.finish_h.relative_half_width:.2%}",
                highlight=False,
            )

    comp = simulate_fleet(
        sc,
        fleet=fleet,
        policies=_policies(policy),
        adjust=cal.adjust if cal else None,
        tolerance=tolerance,
        max_runs=max_replications,
        seed=seed or 0,
        progress=progress,
    )
    if as_json:
        doc = comp.to_dict()
        if cal:
            doc["calibration"] = cal.to_dict()
        emit_json(doc)
        return
    f = comp.fleet
    console.print(
        f"{from_airesim or comp.scenario}: {f.job_servers} servers + {f.warm_standbys} standbys on a working pool "
        f"of {f.working_pool} (spare {f.spare_pool}), {f.work_days:g} days of work, "
        f"{f.failures_per_server_day:g} failures per server-day, {f.bad_fraction:.0%} bad at "
        f"{1 + f.bad_multiplier:g}x",
        highlight=False,
    )
    res = list(comp.results.values())
    rows: list[list[Any]] = [
        ["recovery per failure (s)", *[f"{r.charge.downtime_s:.1f}" for r in res]],
        ["replications", *[f"{len(r.runs)}" + ("" if r.converged else " (cap)") for r in res]],
        ["time to finish (h)", *[f"{r.finish_h.mean:,.0f} ± {r.finish_h.half_width:,.0f}" for r in res]],
        [
            "effective training ratio",
            *[f"{r.effective_training_ratio.mean:.4f} ± {r.effective_training_ratio.half_width:.4f}" for r in res],
        ],
        ["failures (mean)", *[f"{sum(x.failures for x in r.runs) / len(r.runs):,.0f}" for r in res]],
        ["depleted runs", *[sum(x.depleted for x in r.runs) for r in res]],
    ]
    console.print(table("per policy, 95 % intervals", ["", *[r.charge.policy.value for r in res]], rows))


def _print_calibration(cal: Any) -> None:
    """Per policy, which stages the recording measured and which stayed the model's defaults;
    the peer-copy model calibrated from the recorded copies, predicted against measured."""
    from meshpact.core.recovery import Policy, Stage
    from meshpact.simulator.calibrate import Provenance

    console.print(f"stage durations calibrated from {cal.source} ({cal.ranks} ranks)")
    pols = [p for p in Policy]
    rows: list[list[Any]] = [["recoveries recorded", *[cal.recoveries.get(p, 0) for p in pols]]]
    for stage in Stage.ordered():
        if stage is Stage.REPLAY:
            continue
        cells = []
        for p in pols:
            src = cal.provenance(p).get(stage)
            cells.append(
                "-" if src is None else f"{cal.measured[p][stage]:.3g} s" if src is Provenance.RECORDING else "model"
            )
        rows.append([stage.value, *cells])
    moved = cal.state_bytes or {}
    rows.append(["state bytes moved (mean)", *[f"{moved[p].bytes / 1e6:.3g} MB" if p in moved else "-" for p in pols]])
    console.print(table("calibration: measured (s) or the cost model's default", ["", *[p.value for p in pols]], rows))
    pc = cal.peer_copy
    if pc is None:
        return
    m = pc.measured

    def err(x: float) -> str:
        return "-" if x == float("inf") else f"{x:+.1%}"

    console.print(
        f"peer copies (K={m.copies}): {m.bytes_per_commit / 1e6:.3g} MB per rank and commit, shipped in "
        f"{m.ship_s * 1e3:.1f} ms (calibrated peer_bytes_per_s {pc.costs.peer_bytes_per_s / 1e6:.3g} MB/s), "
        f"step {m.step_s * 1e3:.1f} ms; {pc.costs.cores_per_rank:.3g} cores per rank (measured, not fitted)"
    )
    console.print(
        table(
            "peer-copy overhead per step: measured against the calibrated model",
            ["", "measured", "model", "error"],
            [
                [
                    "seconds per step",
                    f"{m.measured_s_per_step * 1e3:.2f} ms",
                    f"{pc.predicted_s_per_step * 1e3:.2f} ms",
                    err(pc.error),
                ],
                ["step latency", f"{pc.measured_overhead:+.2%}", f"{pc.predicted_overhead:+.2%}", ""],
            ],
        )
    )


def _print_replay(replay: Any) -> None:
    """The recorded live run against its calibrated simulation."""
    run = replay.run
    console.print(
        f"live run replayed ({replay.to_dict()['policy']}): {run.ranks} ranks, {run.steps} steps, "
        f"{len(run.faults)} {run.fault_kind} faults; measured step {run.step_s * 1e3:.1f} ms, "
        f"checkpoint write {run.checkpoint_s * 1e3:.1f} ms, first-step warm-up {run.warmup_s:.3f} s"
    )

    def pct(x: float | None) -> str:
        return "-" if x is None else f"{x:+.1%}"

    rows: list[list[Any]] = [
        [f"downtime, fault at step {f.step} (s)", f"{f.measured_s:.4f}", f"{f.predicted_s:.4f}", pct(f.error)]
        for f in replay.faults
    ]
    rows.append(
        [
            "downtime per fault, mean (s)",
            f"{replay.measured_downtime_s:.4f}",
            f"{replay.predicted_downtime_s:.4f}",
            pct(replay.downtime_error),
        ]
    )
    rows.append(
        ["training loop, total (s)", f"{run.total_s:.3f}", f"{replay.predicted_total_s:.3f}", pct(replay.total_error)]
    )
    if replay.steady is not None:
        rows.append(
            ["after the first step (s)", f"{replay.steady[0]:.3f}", f"{replay.steady[1]:.3f}", pct(replay.steady_error)]
        )
    console.print(table("live run: measured against simulated", ["", "measured", "simulated", "error"], rows))
    for note in replay.notes:
        console.print(f"note: {note}")


def serving(
    scenario: str = typer.Option("serving_spillover", "--scenario", help="Scenario file or built-in name."),
    model: Optional[str] = typer.Option(
        None,
        "--model",
        help="A preset of the scenario's serving section (the shipped scenario's: dense, moe, minimax).",
    ),
    concurrency: Optional[int] = typer.Option(None, "--concurrency", min=1, help="Requests in flight."),
    request: Optional[Request] = typer.Option(
        None, "--request", help="What the consumer observes (serving takes full, logprob, token or owner_token)."
    ),
    link_gbps: Optional[float] = typer.Option(None, "--link-gbps", help="Link bandwidth in Gbit/s."),
    requests: Optional[int] = typer.Option(None, "--requests", min=1, help="Requests to complete."),
    deployment: Deployment = typer.Option(
        Deployment.REQUESTS,
        "--deployment",
        help="requests (whole requests spill) or model (the model split by layers across the hosts).",
    ),
    speculative: Optional[int] = typer.Option(None, "--speculative", help="GAMMA draft tokens per round."),
    acceptance: Optional[float] = typer.Option(None, "--acceptance", help="A: acceptance rate of one draft token."),
    as_json: bool = typer.Option(False, "--json", help="One JSON document on stdout."),
) -> None:
    """Serving with spillover to a second vendor's host over an α-β link."""
    from meshpact.simulator.batching import simulate_deployment

    r = simulate_deployment(
        _scenario(scenario),
        deployment.value,
        gamma=speculative,
        acceptance=acceptance,
        model=model,
        concurrency=concurrency,
        request=request.value if request else None,
        requests=requests,
        link_gbps=link_gbps,
    )
    if as_json:
        emit_json(r.to_dict())
        return
    p = r.params
    console.print(
        f"{p.model}: {p.request.value} request, concurrency {p.concurrency}, link {p.link_gbit_per_s:g} Gbit/s, "
        f"{deployment.value} deployment" + (f", speculative gamma {p.gamma} alpha {p.alpha:g}" if p.gamma else "")
    )
    d = r.to_dict()
    rows: list[list[Any]] = [
        ["throughput (tok/s)", f"{r.throughput_tok_s:.1f}"],
        ["latency p50 (s)", f"{r.latency_s['p50']:.3f}"],
        ["latency p99 (s)", f"{r.latency_s['p99']:.3f}"],
        ["result bytes", r.result_bytes],
        ["startups", r.startups],
        ["spilled requests", f"{r.spilled} of {r.requests}"],
        ["link utilisation", f"{d['link_utilization']:.2%}"],
        ["tokens per target pass", f"{r.tokens_per_target_pass:.3f}"],
    ]
    console.print(table("serving", ["metric", "value"], rows))


def sweep(
    scenario: str = typer.Option(..., "--scenario", help="Scenario file or built-in name."),
    param: list[str] = typer.Option(..., "--param", help="NAME=V1,V2,... (repeat for a grid)."),
    out: Optional[Path] = typer.Option(None, "--out", help="Save the results (.csv or .parquet)."),
    kind: SweepKind = typer.Option(SweepKind.AUTO, "--kind", help="training, serving, or auto from the parameters."),
    processes: Optional[int] = typer.Option(None, "--processes", help="Worker processes (default: CPUs)."),
    scheduler: Optional[str] = typer.Option(
        None, "--scheduler", help="Run on Dask: tcp://HOST:PORT of a scheduler, or local (a LocalCluster on 127.0.0.1)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Rows as one JSON document on stdout."),
) -> None:
    """Sweep any scenario parameter; one row per point (and policy)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from meshpact.simulator.sweep import (
        MAX_PROCESSES,
        check_out_path,
        check_scheduler,
        parse_param,
        run_sweep,
        save_frame,
    )

    if out:
        check_out_path(out)
    if processes is not None and not 1 <= processes <= MAX_PROCESSES:
        raise MeshpactError(f"--processes {processes}: expected 1..{MAX_PROCESSES} worker processes")
    if scheduler is not None:
        check_scheduler(scheduler)
    params: dict[str, list[Any]] = {}
    for text in param:
        name, values = parse_param(text)
        params[name] = values
    sc = _scenario(scenario)
    with Progress(
        TextColumn("sweep"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err_console,
        transient=as_json,
    ) as bar:
        task = bar.add_task("sweep", total=None)

        def progress(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        frame = run_sweep(sc, params, kind=kind.value, processes=processes, scheduler=scheduler, progress=progress)
    if out:
        save_frame(frame, out)
    if as_json:
        emit_json({"rows": frame.to_dict(orient="records"), "out": str(out) if out else None})
        return
    keep = [
        c
        for c in frame.columns
        if c in params
        or c
        in (
            "policy",
            "goodput",
            "faults",
            "lost_steps",
            "checkpoint_fraction",
            "throughput_tok_s",
            "latency_p50_s",
            "latency_p99_s",
            "result_bytes",
            "startups",
        )
    ]
    cells = ([f"{v:.4g}" if isinstance(v, float) else v for v in row] for row in frame[keep].itertuples(index=False))
    console.print(table("sweep", [c.rsplit(".", 1)[-1] for c in keep], cells))
    if out:
        console.print(f"saved {len(frame)} rows to {out}")


def register(groups: Any) -> None:
    groups.simulate.command("training")(training)
    groups.simulate.command("serving")(serving)
    groups.simulate.command("sweep")(sweep)
