"""The simulator's control-plane costs: fitted to the control-plane scale bench, and used."""

from __future__ import annotations

import importlib.util
import json
import math
import re
from dataclasses import replace
from pathlib import Path
from types import ModuleType

import pytest

from meshpact.core.control_plane import Growth, fit_control_plane, fit_growth, kept_up, load_control_plane_fit
from meshpact.core.recovery import Policy, Stage
from meshpact.core.recovery_costs import (
    CONTROL_PLANE_FIT,
    DEFAULT_RECOVERY_COSTS,
    FaultImpact,
    RecoveryCosts,
    consensus_seconds,
    estimate_recovery,
    heartbeat_detection_seconds,
)
from meshpact.core.scenario import builtin_scenario_path, load_scenario

ROOT = Path(__file__).resolve().parents[2]
RESULT = ROOT / "bench" / "results" / "control_scale.json"


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("fit_control_plane", ROOT / "scripts" / "fit_control_plane.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return (xs[(len(xs) - 1) // 2] + xs[len(xs) // 2]) / 2


def _kept_up(doc) -> dict:  # noqa: ANN001
    """Per size, the runs whose light ranks kept up (the sizes with none left out)."""
    kept = {n: [r for r in runs if kept_up(r, doc["interval_s"])] for n, runs in doc["runs"].items()}
    return {n: runs for n, runs in kept.items() if runs}


def test_the_heartbeat_fit_is_within_20_percent_of_every_point_the_bench_measured():
    doc = json.loads(RESULT.read_text())
    assert len(_kept_up(doc)) >= 3, "bench/results/control_scale.json kept up at fewer than three sizes"
    for n, runs in _kept_up(doc).items():
        measured = _median([r["server_cpu_s_per_s_heartbeat"] / r["looks_achieved_per_rank_per_s"] for r in runs])
        fitted = CONTROL_PLANE_FIT.heartbeat_store_s.at(int(n))
        assert abs(fitted - measured) <= 0.2 * measured, (
            f"heartbeat store work at {n} ranks: fit {fitted}, measured {measured}"
        )


def test_the_consensus_fit_is_the_least_squares_line_through_the_measured_decisions():
    doc = json.loads(RESULT.read_text())
    measured = {
        int(n): _median([r["decision_ms_after_known"] / 1e3 for r in runs]) for n, runs in _kept_up(doc).items()
    }
    fit = CONTROL_PLANE_FIT.consensus_s
    assert {p.ranks: p.value for p in fit.points} == pytest.approx(measured)

    def rms(f) -> float:
        return math.sqrt(sum(e * e for e in f.errors()) / len(f.errors()))

    # no nearby line of the kept form with an intercept >= 0 has a smaller relative residual
    for da, db in ((0.0, 1.02), (0.0, 0.98), (0.01, 1.0), (0.01, 0.98)):
        other = replace(fit, intercept=fit.intercept + da * fit.at(max(measured)), slope=fit.slope * db)
        assert rms(other) >= rms(fit)


def test_the_shipped_fit_is_the_fit_of_the_result_file_now():
    fresh = fit_control_plane(json.loads(RESULT.read_text()))
    assert load_control_plane_fit() == fresh == CONTROL_PLANE_FIT, (
        "scenarios/control_plane_fit.json is not the fit of bench/results/control_scale.json: "
        "run python scripts/fit_control_plane.py"
    )
    assert fresh.source.file == "bench/results/control_scale.json" and fresh.source.commit


def test_a_size_whose_light_ranks_did_not_keep_up_is_left_out_of_both_fits():
    """At 4,096 light ranks on two cores each ranks looks about twice a second, not 20 times: its figures
    measure the simulation's CPU. A size is fitted only where its ranks kept half the look rate or more."""

    def run(n: int, looks: float) -> dict:
        return {
            "ranks": n,
            "looks_achieved_per_rank_per_s": looks,
            "server_cpu_s_per_s_heartbeat": n * 1e-3,
            "decision_ms_after_known": n / 6.4 if looks >= 10 else 17000.0,
        }

    doc = {
        "watch": "ring",
        "interval_s": 0.05,
        "runs": {
            "64": [run(64, 20.0)],
            "256": [run(256, 19.0)],
            "1024": [run(1024, 10.0)],
            "4096": [run(4096, 2.1)],
        },
    }
    fit = fit_control_plane(doc)
    assert sorted(p.ranks for p in fit.consensus_s.points) == [64, 256, 1024]
    assert sorted(p.ranks for p in fit.heartbeat_store_s.points) == [64, 256, 1024]
    doc["runs"]["1024"] = [run(1024, 9.9)]  # just under half of 20 looks a second
    assert 1024 not in {p.ranks for p in fit_control_plane(doc).consensus_s.points}


def test_a_fit_takes_the_form_its_points_follow():
    linear = fit_growth({64: 0.01 + 64e-4, 256: 0.01 + 256e-4, 1024: 0.01 + 1024e-4})
    assert linear.growth is Growth.LINEAR and linear.intercept == pytest.approx(0.01)
    assert linear.slope == pytest.approx(1e-4) and linear.worst_error() < 1e-9
    log2 = fit_growth({64: 0.05 + 0.02 * 6, 256: 0.05 + 0.02 * 8, 1024: 0.05 + 0.02 * 10})
    assert log2.growth is Growth.LOG2 and log2.per_log2_rank() == pytest.approx(0.02) and log2.per_rank() == 0.0


def test_the_smallest_point_counts_as_much_as_the_largest():
    # noise of +-10 % at every size: an absolute least-squares line misses the 64-rank point by far more
    f = fit_growth({64: 0.064 * 1.1, 256: 0.256 * 0.9, 1024: 1.024 * 1.1, 4096: 4.096 * 0.9})
    assert f.worst_error() < 0.2


def test_points_no_line_follows_miss_by_more_than_20_percent():
    # the run measured under a load of 125: no monotone a + b*N or a + b*log2 N passes near all three
    f = fit_growth({64: 0.0457, 256: 1.4017, 1024: 0.8656})
    assert f.worst_error() > 0.2 and f.intercept >= 0 and f.slope >= 0


@pytest.mark.parametrize(
    ("points", "message"),
    [
        ({1024: 1.0}, "two sizes or more"),
        ({64: 1.0, 1024: 0.0}, "above zero"),
        ({64: 1.0, 256: 0.5, 1024: 0.25}, "fall as the ranks grow (64: 1, 256: 0.5, 1024: 0.25)"),
    ],
)
def test_points_that_make_no_cost_model_are_refused_by_name(points, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        fit_growth(points)


def test_the_cost_model_prices_consensus_and_hang_detection_from_the_fit():
    fit = CONTROL_PLANE_FIT
    for ranks in (64, 1024, 16384):
        hang = estimate_recovery(Policy.IN_MEMORY, ranks, impact=FaultImpact.HANG).durations_s
        assert hang[Stage.CONSENSUS] == pytest.approx(fit.consensus_s.at(ranks))
        look = max(fit.interval_s, fit.heartbeat_store_s.at(ranks))
        assert hang[Stage.DETECTION] == pytest.approx(
            DEFAULT_RECOVERY_COSTS.heartbeat_timeout_s * look / fit.interval_s
        )
    # a store that keeps the interval detects in the timeout; one that cannot stretches it
    quick = RecoveryCosts(
        heartbeat_store_s=0.0,
        heartbeat_store_per_rank_s=1e-6,
        heartbeat_store_per_log2_rank_s=0.0,
        heartbeat_interval_s=0.05,
        heartbeat_timeout_s=5.0,
    )
    assert heartbeat_detection_seconds(1024, quick) == pytest.approx(5.0)
    assert heartbeat_detection_seconds(100_000, quick) == pytest.approx(5.0 * 0.1 / 0.05)


def test_the_16384_rank_scenarios_price_consensus_with_the_fit():
    for name in ("whatif_16384_30d", "whatif_16384_30d_nodes"):
        sc = load_scenario(builtin_scenario_path(name))
        costs = sc.recovery.recovery_costs()
        ranks = sc.mesh().world_size
        assert ranks == 16384
        assert consensus_seconds(ranks, costs) == pytest.approx(CONTROL_PLANE_FIT.consensus_s.at(ranks))
        assert estimate_recovery("excise", ranks, costs).durations_s[Stage.CONSENSUS] == pytest.approx(
            CONTROL_PLANE_FIT.consensus_s.at(ranks)
        )
        assert math.isfinite(heartbeat_detection_seconds(ranks, costs))


def test_the_fit_script_checks_the_shipped_file_and_refuses_a_bad_result_in_one_line(tmp_path, capsys):
    script = _script()
    assert script.main(["--check"]) == 0
    capsys.readouterr()
    stale = tmp_path / "fit.json"
    stale.write_text(json.dumps({**CONTROL_PLANE_FIT.to_dict(), "interval_s": 0.1}))
    assert script.main(["--check", "--out", str(stale)]) == 1
    assert "is not the fit of" in capsys.readouterr().err
    bad = tmp_path / "control_scale.json"
    bad.write_text(json.dumps({"watch": "all", "runs": {}}))
    assert script.main(["--result", str(bad), "--out", str(tmp_path / "out.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "watch: ring" in err and not (tmp_path / "out.json").exists()
    capsys.readouterr()
    fresh = tmp_path / "fresh.json"
    assert script.main(["--out", str(fresh)]) == 0
    assert fresh.read_text() == (ROOT / "scenarios" / "control_plane_fit.json").read_text()


def test_the_fit_round_trips_through_its_file_and_a_broken_file_says_how_to_rewrite_it(tmp_path):
    path = tmp_path / "fit.json"
    path.write_text(json.dumps(CONTROL_PLANE_FIT.to_dict()))
    assert load_control_plane_fit(str(path)) == CONTROL_PLANE_FIT
    path.write_text("{}")
    with pytest.raises(ValueError, match="not a control-plane fit .* python scripts/fit_control_plane.py"):
        load_control_plane_fit(str(path))
