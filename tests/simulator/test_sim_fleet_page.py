"""The Simulate page's fleet tab: inputs checked by the fleet's schema before anything runs,
and each policy's estimate shown with its interval."""

from __future__ import annotations

from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

MAIN = str(Path(__file__).resolve().parents[2] / "app" / "main.py")


def _number(at: AppTest, label: str):  # noqa: ANN202 (AppTest's element)
    for n in at.number_input:
        if n.label == label:
            return n
    raise AssertionError(f"no number input {label!r}")


def _run_fleet(at: AppTest) -> AppTest:
    return next(b for b in at.button if b.label == "Run the fleet").click().run()


@pytest.mark.slow  # the page's training sweeps run once on the default scenario, then two fleet runs
def test_fleet_tab_refuses_a_pool_smaller_than_the_job_then_shows_intervals():
    at = AppTest.from_file(MAIN, default_timeout=120).run()
    at.switch_page("views/simulate.py").run()
    assert not at.exception
    _number(at, "job servers").set_value(64)
    _number(at, "warm standbys").set_value(8)
    _number(at, "working pool").set_value(70)
    _number(at, "work (days)").set_value(20.0)
    _run_fleet(at)
    errors = [e.value.replace("\\", "") for e in at.error]
    assert len(errors) == 1 and "working_pool 70 is smaller than job_servers + warm_standbys = 72" in errors[0]
    assert not at.get("plotly_chart") or all("fleet" not in str(c.proto) for c in at.get("plotly_chart"))
    _number(at, "working pool").set_value(80)
    _number(at, "spare pool").set_value(4)
    _number(at, "Weibull shape / lognormal sigma").set_value(0.0)
    next(s for s in at.selectbox if s.label == "time to failure").set_value("weibull")
    _run_fleet(at)
    errors = [e.value.replace("\\", "") for e in at.error]
    assert len(errors) == 1 and "weibull_shape" in errors[0] and "greater than 0" in errors[0]
    _number(at, "Weibull shape / lognormal sigma").set_value(1.5)
    next(m for m in at.multiselect if m.label == "policies").set_value(["cold_restart", "excise"])
    _run_fleet(at)
    assert not at.exception and not at.error
    frame = at.dataframe[-1].value
    assert list(frame["policy"]) == ["cold_restart", "excise"]
    assert (frame["finish_h_half_width"] <= 0.02 * frame["finish_h"]).all() or (frame["replications"] == 50).any()
    assert (frame["finish_h"] > 20 * 24).all() and (frame["effective_training_ratio"] < 1).all()
