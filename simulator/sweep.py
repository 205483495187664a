"""Sweeps: run a scenario over the cartesian product of parameter values, in parallel.

A parameter is any dotted scenario field (``checkpointing.every_steps``) or one of the
CLI's short names (:data:`ALIASES`). Every point is validated before anything runs, so a
bad name or value fails at once with the field named. Points run in worker processes of
this machine, or on a Dask distributed cluster (``scheduler="tcp://HOST:PORT"``, or
``"local"`` for a ``LocalCluster`` bound to loopback) when the grid outgrows one machine.
Either way a point is a pure function of the scenario and its values (seeds included), so
both engines give the same rows; the result is a pandas DataFrame, one row per point (and
per policy for training), in grid order, saved as CSV or Parquet by :func:`save_frame`.
"""

from __future__ import annotations

import itertools
import os
import re
from concurrent.futures import ProcessPoolExecutor, as_completed
from enum import Enum
from multiprocessing import get_context
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import yaml

from meshpact.core.errors import MeshpactError, ScenarioError
from meshpact.core.facts import LinkClass
from meshpact.core.scenario import Scenario, parse_scenario, with_overrides

__all__ = [
    "SweepKind",
    "ALIASES",
    "MAX_POINTS",
    "MAX_PROCESSES",
    "parse_param",
    "sweep_points",
    "run_sweep",
    "check_out_path",
    "check_scheduler",
    "save_frame",
]


class SweepKind(str, Enum):
    """What each point of a sweep simulates."""

    AUTO = "auto"  # serving when a parameter lies in the serving section, else training
    TRAINING = "training"
    SERVING = "serving"


MAX_POINTS = 100_000  # points in one sweep (the product of every parameter's values)
MAX_PROCESSES = 1024
_SUFFIXES = (".csv", ".parquet", ".pq")

ALIASES: Mapping[str, str] = {
    "ranks": "workload.ranks",
    "days": "workload.days",
    "step_seconds": "workload.step_seconds",
    "model_name": "workload.model",
    "rank_mtbf_hours": "faults.rank_mtbf_hours",
    "rank_loss_mtbf_hours": "faults.rank_loss_mtbf_hours",
    "hang_mtbf_hours": "faults.hang_mtbf_hours",
    "node_fraction": "faults.node_fraction",
    "rack_fraction": "faults.rack_fraction",
    "spare_ranks": "faults.spare_ranks",
    "checkpoint_age": "faults.at_checkpoint_age.steps",
    "work_steps": "workload.work_steps",
    "step_time_cv": "workload.step_time_cv",
    "seed": "faults.seed",
    "checkpoint_every": "checkpointing.every_steps",
    "checkpoint_seconds": "checkpointing.seconds",
    "checkpoint_mode": "checkpointing.mode",
    "model": "serving.model",
    "concurrency": "serving.concurrency",
    "request": "serving.request",
    "link_gbps": "serving.link.gbit_per_s",
}


def parse_param(text: str) -> tuple[str, list[Any]]:
    """``NAME=V1,V2,...`` -> (dotted path, values); values are read as YAML scalars."""
    name, sep, values = text.partition("=")
    name = name.strip()
    if not sep or not name or not values.strip():
        raise MeshpactError(f"--param {text!r}: expected NAME=V1,V2,... such as checkpointing.every_steps=100,200")
    parsed = []
    for v in values.split(","):
        try:
            parsed.append(yaml.safe_load(v.strip()))
        except yaml.YAMLError:
            raise MeshpactError(f"--param {text!r}: value {v!r} is not a number or a word") from None
    return ALIASES.get(name, name), parsed


def _point_overrides(scenario: Scenario, point: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for path, value in point.items():
        if path == "serving.link.gbit_per_s":
            link = (
                scenario.serving.link.params()
                if scenario.serving and scenario.serving.link
                else scenario.link(LinkClass.ETHERNET)
            )
            out["serving.link"] = {"alpha_s": link.alpha_s, "gbit_per_s": value}
            continue
        out[path] = value
        if path == "workload.step_seconds":
            out["workload.tokens_per_step"] = None
    return out


def sweep_points(params: Mapping[str, Sequence[Any]]) -> list[dict[str, Any]]:
    names = list(params)
    count = 1
    for n in names:
        count *= max(len(params[n]), 1)
    if count > MAX_POINTS:
        raise MeshpactError(
            f"--param: the grid has {count:,} points, over the limit of {MAX_POINTS:,}; "
            "sweep fewer values or split the grid"
        )
    return [dict(zip(names, combo)) for combo in itertools.product(*(list(params[n]) for n in names))]


def _run_point(scenario_data: dict[str, Any], name: str, point: dict[str, Any], kind: str) -> list[dict[str, Any]]:
    from .serving import simulate_serving
    from .training import simulate_training

    scenario = parse_scenario(scenario_data, name)
    scenario = with_overrides(scenario, _point_overrides(scenario, point), source=name)
    label = {k: v for k, v in point.items()}
    if kind == "serving":
        frame = simulate_serving(scenario).to_frame()
    else:
        frame = simulate_training(scenario, timeline=False).to_frame()
    return [{**label, **row} for row in frame.to_dict(orient="records")]


_SCHEDULER = re.compile(r"^tcp://(\[[0-9a-fA-F:]+\]|[A-Za-z0-9.-]+):(\d{1,5})$")


def check_scheduler(address: str) -> str:
    """``local`` or ``tcp://HOST:PORT`` (a Dask scheduler), refused at once otherwise."""
    if address == "local":
        return address
    m = _SCHEDULER.match(address)
    if not m or not 1 <= int(m.group(2)) <= 65535:
        raise MeshpactError(f"--scheduler {address!r}: expected local or tcp://HOST:PORT such as tcp://10.0.0.5:8786")
    return address


def _run_on_dask(
    scheduler: str,
    workers: int,
    data: dict[str, Any],
    name: str,
    points: list[dict[str, Any]],
    kind: str,
    results: list[list[dict[str, Any]] | None],
    progress: Callable[[int, int], None] | None,
) -> None:
    try:
        from dask.distributed import Client, LocalCluster, as_completed as dask_completed
    except ImportError:
        raise MeshpactError(
            f"--scheduler {scheduler}: needs dask.distributed (pip install 'dask[distributed]')"
        ) from None
    import logging

    cluster = None
    # a LocalCluster's workers log their lost connections while it shuts down: not news to the user
    quiet = logging.getLogger("distributed")
    level = quiet.level
    if scheduler == "local":
        quiet.setLevel(logging.CRITICAL)
    try:
        if scheduler == "local":
            cluster = LocalCluster(
                n_workers=workers,
                threads_per_worker=1,
                processes=True,
                host="127.0.0.1",
                dashboard_address=None,
                silence_logs=logging.ERROR,
            )
            client = Client(cluster)
        else:
            client = Client(scheduler, timeout="10s")
    except (OSError, RuntimeError) as exc:  # an unreachable scheduler, or local workers that cannot start
        if cluster is not None:
            cluster.close()
        quiet.setLevel(level)
        if scheduler == "local":
            raise MeshpactError(
                f"--scheduler local: cannot start a LocalCluster ({exc}); run the sweep from a "
                "script guarded by if __name__ == '__main__', or without --scheduler"
            ) from None
        raise MeshpactError(
            f"--scheduler {scheduler}: cannot reach the scheduler ({exc}); start one with "
            "dask scheduler, or use --scheduler local"
        ) from None
    try:
        [shared] = client.scatter([data], broadcast=True)
        futures = [client.submit(_run_point, shared, name, p, kind, pure=False) for p in points]
        index = {f.key: i for i, f in enumerate(futures)}
        for done, fut in enumerate(dask_completed(futures), 1):
            results[index[fut.key]] = fut.result()
            if progress:
                progress(done, len(points))
    finally:
        client.close()
        if cluster is not None:
            cluster.close()
        quiet.setLevel(level)


def run_sweep(
    scenario: Scenario,
    params: Mapping[str, Sequence[Any]],
    *,
    kind: SweepKind | str = SweepKind.AUTO,
    processes: int | None = None,
    scheduler: str | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> Any:
    """Run every point of the sweep; returns a DataFrame with one column per parameter.

    ``kind``: ``training``, ``serving`` or ``auto`` (serving when a parameter lies in the
    serving section). ``processes``: worker processes (default: CPU count, at most the
    number of points; 1 runs in this process), also the workers of ``scheduler="local"``.
    ``scheduler``: run on Dask instead (see :func:`check_scheduler`). ``progress(done,
    total)`` after each point.
    """
    import pandas as pd

    if not params:
        raise MeshpactError("a sweep needs at least one --param NAME=V1,V2,...")
    params = {ALIASES.get(k, k): list(v) for k, v in params.items()}
    try:
        chosen = SweepKind(kind)
    except ValueError:
        raise MeshpactError(f"sweep kind {kind!r}: expected one of {', '.join(k.value for k in SweepKind)}") from None
    if chosen is SweepKind.AUTO:
        chosen = SweepKind.SERVING if any(k.startswith("serving.") for k in params) else SweepKind.TRAINING
    kind = chosen.value  # the points' workers take the plain name
    if processes is not None and not 1 <= processes <= MAX_PROCESSES:
        raise MeshpactError(f"--processes {processes}: expected 1..{MAX_PROCESSES} worker processes")
    if scheduler is not None:
        check_scheduler(scheduler)
    points = sweep_points(params)
    for point in points:  # fail before any work with the field named
        with_overrides(scenario, _point_overrides(scenario, point), source=f"{scenario.name} sweep {point}")
    if kind == "serving" and scenario.serving is None:
        raise ScenarioError(f"{scenario.name}: serving: a serving sweep needs a scenario with a serving section")
    data = scenario.model_dump(mode="json")
    workers = max(1, min(processes or os.cpu_count() or 1, len(points)))
    results: list[list[dict[str, Any]] | None] = [None] * len(points)
    if scheduler is not None:
        _run_on_dask(scheduler, workers, data, scenario.name, points, kind, results, progress)
    elif workers == 1:
        for i, point in enumerate(points):
            results[i] = _run_point(data, scenario.name, point, kind)
            if progress:
                progress(i + 1, len(points))
    else:
        with ProcessPoolExecutor(max_workers=workers, mp_context=get_context("spawn")) as pool:
            futures = {pool.submit(_run_point, data, scenario.name, p, kind): i for i, p in enumerate(points)}
            for done, fut in enumerate(as_completed(futures), 1):
                results[futures[fut]] = fut.result()
                if progress:
                    progress(done, len(points))
    return pd.DataFrame([row for rows in results for row in (rows or [])])


def check_out_path(path: str | os.PathLike[str]) -> Path:
    """Refuse an output name the sweep could not write, before the sweep runs.

    The suffix must be ``.csv`` or ``.parquet``, the folder must exist (it is not created:
    a typo in a folder name should not silently make a new tree) and be writable, and
    Parquet needs pyarrow.
    """
    p = Path(path)
    suffix = p.suffix.lower()
    if suffix not in _SUFFIXES:
        raise MeshpactError(f"--out {p}: expected a .csv or .parquet file name")
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise MeshpactError(f"--out {p}: folder {parent} does not exist; create it first or choose another path")
    if not os.access(parent, os.W_OK):
        raise MeshpactError(f"--out {p}: folder {parent} is not writable")
    if p.is_dir():
        raise MeshpactError(f"--out {p}: is a folder; expected a file name ending in .csv or .parquet")
    if suffix != ".csv":
        try:
            import pyarrow  # noqa: F401
        except ImportError:
            raise MeshpactError(
                f"--out {p}: writing Parquet needs pyarrow (pip install pyarrow), or use .csv"
            ) from None
    return p


def save_frame(frame: Any, path: str | os.PathLike[str]) -> Path:
    """Save a DataFrame as CSV (``.csv``) or Parquet (``.parquet``); see :func:`check_out_path`."""
    p = check_out_path(path)
    try:
        if p.suffix.lower() == ".csv":
            frame.to_csv(p, index=False)
        else:
            frame.to_parquet(p, index=False)
    except ImportError:
        raise MeshpactError(f"--out {p}: writing Parquet needs pyarrow (pip install pyarrow), or use .csv") from None
    except OSError as exc:
        raise MeshpactError(f"--out {p}: cannot write ({exc.strerror})") from None
    return p
