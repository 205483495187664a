"""Simulate page: what-if knobs for training with faults, a job on a fleet of servers, and serving spillover.

The fleet tab runs AIReSim's cluster model (:mod:`meshpact.core.fleet`): every input is
checked by the fleet's schema before anything runs, and each policy is replicated until the
95 % interval of its time to finish and effective training ratio is within the tolerance.

The serving tab sweeps the request kinds over concurrency, then puts the two deployments
side by side (``requests``: whole requests spill to the second host; ``model``: the
decoder is split across the hosts, so every step crosses the link), each without and with
speculative decoding at the chosen γ and acceptance rate (a what-if: the simulator draws
the acceptances)."""

from __future__ import annotations

import json
from typing import Any, Callable, Sequence

import pandas as pd
import streamlit as st
from streamlit.delta_generator import DeltaGenerator

from meshpact.app.context import mesh_of, message_markdown, require_scenario
from meshpact.app.figures import fleet_figure, goodput_figure, recovery_figure, serving_figure
from meshpact.app.format import count, duration
from meshpact.app.policies import compare_policies
from meshpact.app.state import FAILED_KEY, clamp_failed, format_ranks
from meshpact.app.widgets import number_box
from meshpact.app.whatif import (
    CHECKPOINT_EVERY,
    CONCURRENCY,
    MTBF_HOURS,
    goodput_curve,
    serving_curve,
    serving_scenario,
)
from meshpact.core.scenario import SERVING_REQUESTS, Deployment
from meshpact.core.errors import MeshpactError, ScenarioError
from meshpact.core.fleet import FailureDistribution, FleetSpec, parse_fleet
from meshpact.core.recovery import Policy
from meshpact.core.recovery import RecoveryBreakdown
from meshpact.simulator.serving import expected_tokens_per_pass

choice = require_scenario()
st.title("Simulate")
scenario = choice.scenario


def cached_run(name: str, key: tuple, label: str, run: Callable[[Callable[[int, int], None]], Any]) -> Any:
    """Run once per distinct knob setting, with a progress bar; keep the result for reruns."""
    memo = st.session_state.setdefault("simulate_results", {})
    if memo.get(name, (None,))[0] != key:
        bar = st.progress(0.0, text=label)

        def progress(done: int, total: int) -> None:
            bar.progress(done / total, text=f"{label} {done}/{total}")

        result = run(progress)
        bar.empty()
        memo[name] = (key, result)
    return memo[name][1]


# Sweeps and runs are kept for every session of this server: a second visit, or a second
# person with the same setting, does not simulate again.
@st.cache_data(show_spinner="Simulating the sweep…", max_entries=64)
def sweep(text: str, source: str, knob: str, values: tuple, flags: tuple) -> pd.DataFrame:
    from meshpact.core.scenario import parse_scenario_text

    return goodput_curve(parse_scenario_text(text, source), knob, values, dict(flags))


def deployments(
    serve: Any,
    model: str,
    reqs: tuple,
    gbps: float,
    n: int,
    gamma: int,
    acceptance: float,
    progress: Callable[[int, int], None],
) -> pd.DataFrame:
    """Throughput per deployment, concurrency and request, plain and speculative (γ, acceptance)."""
    from meshpact.simulator.batching import simulate_deployment

    rows = []
    points = [(d.value, c, r) for d in Deployment for c in CONCURRENCY for r in reqs]
    for done, (deployment, c, req) in enumerate(points, 1):
        flags = {"model": model, "concurrency": int(c), "request": req, "requests": n, "link_gbps": gbps}
        plain = simulate_deployment(serve, deployment, **flags)
        spec = simulate_deployment(serve, deployment, gamma=gamma, acceptance=acceptance, **flags)
        rows.append(
            {
                "deployment": deployment,
                "concurrency": int(c),
                "request": req,
                "tok/s": plain.throughput_tok_s,
                "tok/s speculative": spec.throughput_tok_s,
                "speculative gain": spec.throughput_tok_s / plain.throughput_tok_s - 1.0,
                "result bytes/token": plain.result_bytes / max(plain.remote_tokens, 1),
                "speculative result bytes/token": spec.result_bytes / max(spec.remote_tokens, 1),
            }
        )
        progress(done, len(points))
    return pd.DataFrame(rows)


# The deployment tables' columns, titled short enough for both tables to show whole at 1,024 px.
DEPLOYMENT_COLUMNS = {
    "tok/s": st.column_config.NumberColumn("tok/s", format="%.0f"),
    "tok/s speculative": st.column_config.NumberColumn(
        "tok/s spec.", format="%.0f", help="tokens per second with speculative decoding"
    ),
    "speculative gain": st.column_config.NumberColumn("spec. gain", format="percent"),
    "result bytes/token": st.column_config.NumberColumn(
        "bytes/token", format="%.0f", help="result bytes over the link per remote token"
    ),
    "speculative result bytes/token": st.column_config.NumberColumn(
        "bytes/token spec.", format="%.0f", help="result bytes over the link per remote token, speculative"
    ),
}


@st.cache_data(show_spinner="Simulating this setting…", max_entries=64)
def this_setting(text: str, source: str, flags: tuple) -> Any:
    from meshpact.core.scenario import parse_scenario_text
    from meshpact.simulator.training import simulate_training

    return simulate_training(parse_scenario_text(text, source), **dict(flags))


@st.cache_data(show_spinner="Replicating the fleet under each policy…", max_entries=32)
def fleet_runs(text: str, source: str, fleet_json: str, policies: tuple, tolerance: float) -> pd.DataFrame:
    from meshpact.core.fleet import FleetSpec
    from meshpact.core.scenario import parse_scenario_text
    from meshpact.simulator.fleet import simulate_fleet

    fleet = FleetSpec.model_validate_json(fleet_json)
    return simulate_fleet(
        parse_scenario_text(text, source), fleet=fleet, policies=list(policies), tolerance=tolerance, max_runs=50
    ).to_frame()


training, serving, fleet_tab = st.tabs(["Training with faults", "Serving spillover", "Fleet (AIReSim's cluster)"])

with training:
    w, f, c = scenario.workload, scenario.faults, scenario.checkpointing
    st.caption(
        f"{scenario.name}: {w.model}, {w.ranks or 'all'} ranks, faults, checkpoints and recovery from the "
        "scenario; change them here. Every policy replays the same fault trace."
    )
    k: Sequence[DeltaGenerator] = st.columns(5)
    # Typed, not stepped: a value out of range is refused under its box in words, and no figure is drawn
    # for a setting the page does not hold (the figures never stay on an old value beside a new one)
    days = number_box(k[0], "days", 0.5, 60.0, min(float(w.days), 60.0), key="sim_days")
    mtbf = number_box(k[1], "per-rank MTBF (hours)", 10.0, 1e6, float(f.rank_mtbf_hours or 2000.0), key="sim_mtbf")
    every = number_box(k[2], "checkpoint every (steps)", 1, 100_000, int(c.every_steps), key="sim_every", whole=True)
    mode = k[3].selectbox("checkpoint mode", ["sync", "async"], index=0 if c.mode.value == "sync" else 1)
    seed = number_box(k[4], "fault seed", 0, 10_000, int(f.seed), key="sim_seed", whole=True)
    if days is None or mtbf is None or every is None or seed is None:
        st.info("The figures wait for every box above to hold a number it takes.")
        st.stop()
    flags = {
        "days": days,
        "rank_mtbf_hours": mtbf,
        "checkpoint_every": int(every),
        "checkpoint_mode": mode,
        "seed": int(seed),
    }
    key = (choice.text, tuple(sorted(flags.items())))
    try:
        from meshpact.simulator.timeline import chrome_trace

        by_mtbf = sweep(choice.text, choice.source, "rank_mtbf_hours", MTBF_HOURS, key[1])
        by_every = sweep(choice.text, choice.source, "checkpoint_every", CHECKPOINT_EVERY, key[1])
        point = this_setting(choice.text, choice.source, key[1])
    except MeshpactError as exc:
        st.error("**The simulator cannot run this scenario.**\n\n" + message_markdown(str(exc)))
        st.stop()
    cols = st.columns(len(point.policies))
    for col, (policy, res) in zip(cols, point.policies.items()):
        col.metric(
            policy.label,
            f"{res.goodput:.2%}",
            help=f"{count(res.faults)} faults, "
            f"{duration(res.downtime_total_s)} down, {count(res.lost_steps)} steps lost",
        )
    a, b = st.columns(2)
    a.plotly_chart(
        goodput_figure(
            by_mtbf, "rank_mtbf_hours", "goodput against per-rank MTBF", "per-rank MTBF (hours)", current=mtbf
        )
    )
    b.plotly_chart(
        goodput_figure(
            by_every,
            "checkpoint_every",
            "goodput against checkpoint interval",
            "checkpoint every (steps)",
            current=int(every),
        )
    )
    st.plotly_chart(
        recovery_figure([RecoveryBreakdown(p, r.downtime_s) for p, r in point.policies.items()]),
        key="downtime_by_stage",
    )
    st.caption("Total downtime of the run by recovery stage, per policy.")
    picked = clamp_failed(st.session_state.get(FAILED_KEY, []), mesh_of(choice).ranks)
    if picked:
        step_s = float(point.workload.step_s)
        since = int(every) // 2
        cmp = compare_policies(mesh_of(choice), picked, rank_loss=False, steps_since_checkpoint=since, step_s=step_s)
        st.markdown(
            f"**The failures picked on Mesh** (ranks {format_ranks(picked)}), struck halfway between two "
            f"checkpoints of this setting ({count(since)} steps of {duration(step_s)}):"
        )
        st.plotly_chart(recovery_figure(cmp.breakdowns), key="picked_failure")
        for pol, why in cmp.unavailable.items():
            st.caption(f"{pol.label} cannot apply: {why}.")
    else:
        st.page_link("views/mesh.py", label="Pick failures on Mesh to cost them in this setting", icon=":material/hub:")
    d1, d2, d3 = st.columns(3)
    swept = pd.concat([by_mtbf.assign(sweep="rank_mtbf_hours"), by_every.assign(sweep="checkpoint_every")])
    d1.download_button(
        "sweep CSV", data=swept.to_csv(index=False), file_name=f"{scenario.name}-training-sweep.csv", mime="text/csv"
    )
    d2.download_button(
        "this setting CSV",
        data=point.to_frame().to_csv(index=False),
        file_name=f"{scenario.name}-training.csv",
        mime="text/csv",
    )
    d3.download_button(
        "Chrome trace (Perfetto)",
        data=json.dumps(chrome_trace(point)),
        file_name=f"{scenario.name}-timeline.json",
        mime="application/json",
    )

with serving:
    serve, own = serving_scenario(scenario)
    if not own:
        st.info(f"**{scenario.name}** has no serving section; showing the built-in **{serve.name}** scenario.")
    s = serve.serving
    assert s is not None
    with st.form("serving_form"):
        k = st.columns(4)
        model = k[0].selectbox("model preset", list(s.presets), index=list(s.presets).index(s.model))
        reqs = k[1].multiselect("requests", [r.value for r in SERVING_REQUESTS], default=["full", "token"])
        gbps = k[2].number_input("link Gbit/s", 0.1, 400.0, 1.0, step=0.5)
        n = k[3].number_input("requests per run", 20, 2000, 100, step=20)
        run = st.form_submit_button("Run serving sweep", type="primary")
    skey = (serve.model_dump_json(), model, tuple(reqs), gbps, int(n))
    memo = st.session_state.get("simulate_results", {})
    if run:
        if not reqs:
            st.warning("Pick at least one request kind.")
        else:
            try:
                cached_run(
                    "serving",
                    skey,
                    "Simulating serving…",
                    lambda p: serving_curve(
                        serve, reqs, CONCURRENCY, {"model": model, "link_gbps": gbps, "requests": int(n)}, p
                    ),
                )
            except MeshpactError as exc:
                st.error("**The serving simulation failed.**\n\n" + message_markdown(str(exc)))
    memo = st.session_state.get("simulate_results", {})
    if "serving" in memo and memo["serving"][0] == skey:
        frame = memo["serving"][1]
        st.plotly_chart(serving_figure(frame))
        st.caption(
            "Requests spill to the remote host only when the local host's slots are full; until then no "
            "result crosses the link, and zero bytes are not drawn on the log scale."
        )
        st.download_button(
            "serving CSV", data=frame.to_csv(index=False), file_name=f"{serve.name}-serving.csv", mime="text/csv"
        )
    else:
        st.info(
            "Press **Run serving sweep**: each request kind runs at concurrency "
            + ", ".join(map(str, CONCURRENCY))
            + "."
        )

    st.subheader("Both deployments, and speculative decoding")
    with st.form("deployments_form"):
        k = st.columns(3)
        gamma = k[0].number_input("draft tokens per round (γ)", 1, 16, 4)
        acceptance = k[1].number_input("acceptance rate of a draft token", 0.0, 0.99, 0.7, step=0.05)
        both = st.form_submit_button("Compare deployments", type="primary")
    dkey = (skey, int(gamma), float(acceptance))
    if both and reqs:
        try:
            cached_run(
                "deployments",
                dkey,
                "Simulating both deployments…",
                lambda p: deployments(serve, model, tuple(reqs), float(gbps), int(n), int(gamma), float(acceptance), p),
            )
        except MeshpactError as exc:
            st.error("**The deployment comparison failed.**\n\n" + message_markdown(str(exc)))
    kept = st.session_state.get("simulate_results", {}).get("deployments")
    if kept is not None and kept[0] == dkey:
        frame = kept[1]
        for deployment, what in (
            (Deployment.REQUESTS.value, "whole requests spill once host 1's slots are full"),
            (Deployment.MODEL.value, "the decoder split across the hosts: every step crosses"),
        ):
            st.markdown(f"**{deployment}**: {what}")
            st.dataframe(
                frame[frame["deployment"] == deployment].drop(columns="deployment"),
                hide_index=True,
                width="content",
                column_config=DEPLOYMENT_COLUMNS,
            )
        st.caption(
            f"Speculative: γ = {int(gamma)} draft tokens per round, each accepted with probability "
            f"{float(acceptance):.2f} (tokens per target pass (1 − α^(γ+1)) / (1 − α) = "
            f"{expected_tokens_per_pass(int(gamma), float(acceptance)):.2f}). `full` ships the "
            "target's logits for γ + 1 positions; the projected requests verify at the source."
        )
        st.download_button(
            "deployments CSV",
            data=frame.to_csv(index=False),
            file_name=f"{serve.name}-deployments.csv",
            mime="text/csv",
        )
    else:
        st.info(
            "Press **Compare deployments**: the requests above at concurrency "
            + ", ".join(map(str, CONCURRENCY))
            + ", in both deployments, without and with speculation."
        )

with fleet_tab:
    base = scenario.fleet or FleetSpec()
    origin = (
        "the scenario's fleet section" if scenario.fleet else "AIReSim's Table 1 (the scenario has no fleet section)"
    )
    st.caption(
        f"Starting from {origin}: a job on a working pool with warm standbys and a spare pool; bad servers fail at a multiple of the "
        "base rate; failed servers go through automatic, then manual repair. Cold restart is the fleet's "
        "recovery time; the other policies are priced from this scenario's workload and recovery costs."
    )
    with st.form("fleet_form"):
        k = st.columns(5)
        job = k[0].number_input("job servers", 1, 1 << 20, base.job_servers)
        standbys = k[1].number_input("warm standbys", 0, 1 << 20, base.warm_standbys)
        pool = k[2].number_input("working pool", 1, 1 << 20, base.working_pool)
        spare = k[3].number_input("spare pool", 0, 1 << 20, base.spare_pool)
        work = k[4].number_input("work (days)", 0.01, 3650.0, base.work_days, step=1.0)
        k = st.columns(5)
        rate = k[0].number_input(
            "failures per server-day", 0.0, 1000.0, base.failures_per_server_day, step=0.001, format="%.4f"
        )
        bad = k[1].number_input("bad-server fraction", 0.0, 1.0, base.bad_fraction, step=0.05)
        mult = k[2].number_input("bad multiplier (on top of the base)", 0.0, 1e6, base.bad_multiplier, step=0.5)
        dist = k[3].selectbox(
            "time to failure",
            [d.value for d in FailureDistribution],
            index=[d.value for d in FailureDistribution].index(base.distribution.value),
        )
        shape = k[4].number_input(
            "Weibull shape / lognormal sigma",
            0.0,
            100.0,
            base.weibull_shape if dist == "weibull" else base.lognormal_sigma,
            step=0.1,
            help="0 is refused: the shape must be > 0",
        )
        k = st.columns(5)
        recovery = k[0].number_input("recovery (min)", 0.0, 1e6, base.recovery_minutes, step=1.0)
        auto = k[1].number_input("automatic repair (min)", 0.0, 1e7, base.auto_repair_minutes, step=10.0)
        manual = k[2].number_input("manual repair (min)", 0.0, 1e7, base.manual_repair_minutes, step=60.0)
        escalate = k[3].number_input("P(escalate to manual)", 0.0, 1.0, base.escalate_probability, step=0.05)
        diagnose = k[4].number_input("P(diagnosed)", 0.0, 1.0, base.diagnosis_probability, step=0.05)
        k = st.columns(4)
        auto_false = k[0].number_input(
            "P(automatic repair claims success, fault remains)", 0.0, 1.0, base.auto_false_success, step=0.05
        )
        manual_false = k[1].number_input(
            "P(manual repair claims success, fault remains)", 0.0, 1.0, base.manual_false_success, step=0.05
        )
        wrong = k[2].number_input("P(wrong server blamed)", 0.0, 1.0, base.diagnosis_uncertainty, step=0.05)
        tolerance = k[3].number_input("interval within ± (of the mean)", 0.005, 0.2, 0.02, step=0.005, format="%.3f")
        pols = st.multiselect(
            "policies",
            [p.value for p in Policy],
            default=[p.value for p in Policy if p is not Policy.CHECKPOINT_RESTORE],
        )
        go_fleet = st.form_submit_button("Run the fleet", type="primary")
    fields = {
        **base.model_dump(),
        "job_servers": int(job),
        "warm_standbys": int(standbys),
        "working_pool": int(pool),
        "spare_pool": int(spare),
        "work_days": float(work),
        "failures_per_server_day": float(rate),
        "bad_fraction": float(bad),
        "bad_multiplier": float(mult),
        "distribution": dist,
        "recovery_minutes": float(recovery),
        "auto_repair_minutes": float(auto),
        "manual_repair_minutes": float(manual),
        "escalate_probability": float(escalate),
        "diagnosis_probability": float(diagnose),
        "auto_false_success": float(auto_false),
        "manual_false_success": float(manual_false),
        "diagnosis_uncertainty": float(wrong),
    }
    fields["weibull_shape" if dist == "weibull" else "lognormal_sigma"] = float(shape)
    fkey = (choice.text, json.dumps(fields, sort_keys=True, default=str), tuple(pols), float(tolerance))
    if go_fleet:
        try:
            checked = parse_fleet(fields, "fleet")
            if not pols:
                raise ScenarioError("policies: pick at least one policy")
            frame = fleet_runs(choice.text, choice.source, checked.model_dump_json(), tuple(pols), float(tolerance))
            st.session_state.setdefault("simulate_results", {})["fleet"] = (fkey, frame)
        except MeshpactError as exc:
            st.error("**The fleet cannot run.**\n\n" + message_markdown(str(exc)))
    kept = st.session_state.get("simulate_results", {}).get("fleet")
    if kept is not None and kept[0] == fkey:
        frame = kept[1]
        st.plotly_chart(fleet_figure(frame), key="fleet_by_policy")
        st.dataframe(
            frame,
            hide_index=True,
            column_config={
                "finish_h": st.column_config.NumberColumn("time to finish (h)", format="%.0f"),
                "finish_h_half_width": st.column_config.NumberColumn("± (h)", format="%.1f"),
                "effective_training_ratio": st.column_config.NumberColumn("effective training ratio", format="%.4f"),
                "effective_training_ratio_half_width": st.column_config.NumberColumn("±", format="%.4f"),
            },
        )
        st.caption(
            f"Means over the replications with their 95 % intervals (the error bars); each policy ran until "
            f"both intervals were within ±{float(tolerance):.1%} of the mean, or 50 replications."
        )
        st.download_button(
            "fleet CSV", data=frame.to_csv(index=False), file_name=f"{scenario.name}-fleet.csv", mime="text/csv"
        )
    else:
        st.info("Press **Run the fleet**: each policy is replicated until its interval is within the tolerance.")
