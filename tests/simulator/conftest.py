"""Scenarios built in code for the simulator's tests."""

from __future__ import annotations

from typing import Any

import pytest

from meshpact.core.scenario import Scenario, parse_scenario

CLUSTER = {
    "domains": [
        {"name": "cuda@hostA", "vendor": "cuda", "host": "hostA", "ranks": 16},
        {"name": "cann@hostB", "vendor": "cann", "host": "hostB", "ranks": 16},
    ],
    "links": {"ethernet": {"alpha_s": 5e-5, "gbit_per_s": 1}, "fabric": {"alpha_s": 5e-6, "gbit_per_s": 800}},
}


def scenario(**sections: Any) -> Scenario:
    data: dict[str, Any] = {"name": "test", "cluster": CLUSTER}
    data.update(sections)
    return parse_scenario(data, "test.yaml")


@pytest.fixture
def make_scenario():
    return scenario
