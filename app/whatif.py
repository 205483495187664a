"""What-if sweeps for the Simulate page: goodput curves and serving spillover curves.

Each function runs the simulator over a list of values of one knob and returns a pandas
DataFrame, one row per value (and per policy or request kind), calling
``progress(done, total)`` after each run so the page can show a progress bar. The
curves are what the page plots: goodput against the per-rank MTBF and against the
checkpoint interval, and serving throughput and link traffic against concurrency.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

from meshpact.core.scenario import Scenario, builtin_scenario_path, load_scenario

__all__ = ["MTBF_HOURS", "CHECKPOINT_EVERY", "CONCURRENCY", "goodput_curve", "serving_scenario", "serving_curve"]

Progress = Callable[[int, int], None]

MTBF_HOURS = (250, 500, 1000, 2000, 4000, 8000, 16000)
CHECKPOINT_EVERY = (50, 100, 200, 500, 1000, 2000)
CONCURRENCY = (1, 2, 4, 8, 16, 32)


def goodput_curve(
    scenario: Scenario,
    knob: str,
    values: Sequence[Any],
    flags: Mapping[str, Any],
    progress: Progress | None = None,
) -> Any:
    """Goodput, downtime and lost steps of every policy for each value of ``knob``
    (a flag of :func:`meshpact.simulator.training.simulate_training`), the other flags
    fixed. All values share one fault seed, so curves differ only by the knob."""
    import pandas as pd

    from meshpact.simulator.training import simulate_training

    rows = []
    for i, value in enumerate(values):
        result = simulate_training(scenario, timeline=False, **{**dict(flags), knob: value})
        for row in result.to_frame().to_dict(orient="records"):
            rows.append({knob: value, **row})
        if progress:
            progress(i + 1, len(values))
    return pd.DataFrame(rows)


def serving_scenario(scenario: Scenario) -> tuple[Scenario, bool]:
    """The scenario to serve: this one when it has a serving section, else the built-in
    ``serving_spillover`` (the flag says which)."""
    if scenario.serving is not None:
        return scenario, True
    return load_scenario(builtin_scenario_path("serving_spillover")), False


def serving_curve(
    scenario: Scenario,
    requests: Sequence[str],
    concurrency: Sequence[int],
    flags: Mapping[str, Any],
    progress: Progress | None = None,
) -> Any:
    """Throughput, result bytes over the link and latency for each request kind and
    concurrency (``flags``: model, link_gbps, requests, output_tokens)."""
    import pandas as pd

    from meshpact.simulator.serving import simulate_serving

    frames = []
    total, done = len(requests) * len(concurrency), 0
    for req in requests:
        for c in concurrency:
            frames.append(simulate_serving(scenario, request=req, concurrency=int(c), **dict(flags)).to_frame())
            done += 1
            if progress:
                progress(done, total)
    return pd.concat(frames, ignore_index=True)
