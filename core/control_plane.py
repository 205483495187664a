"""The live control plane's costs at N ranks, fitted to what ``bench/control_scale.py`` measured.

The simulator prices two things the live control plane does, and both are fitted here to the
control-plane scale bench's result (``bench/results/control_scale.json``), not assumed:

| cost | measured at each N as | used by the cost model as |
|---|---|---|
| ``consensus_s`` | every rank knows of the fault -> every rank holds the decision (each run's ``decision_ms_after_known``) | the consensus stage of every recovery |
| ``heartbeat_store_s`` | the control store's CPU seconds per round of heartbeat looks (every rank one look): its CPU per second of the heartbeat phase over the looks per rank it served that second | a hang found by the heartbeat: the store serves a round in ``heartbeat_store_s``; when that is longer than the heartbeat interval, every look, and so the detection bound counted in looks, stretches by the ratio |

Each cost is one :class:`CostFit`: least squares over the measured points for two model forms,
``a + b * N`` and ``a + b * log2 N`` (:class:`Growth`), the form with the smaller residual
kept. The squares are of *relative* residuals (each point weighted by one over its value): the
points span N = 64 to 1,024 and their values an order of magnitude or more, and an absolute
fit would spend all its freedom on the largest point while missing the smallest by a factor.
Which form wins is the data's answer, not an assumption. A fit that misses a measured point by
more than 20 % is still the best line of the two forms, and ``scripts/fit_control_plane.py``
says so. Sizes whose light ranks could not keep the heartbeat's pace (:func:`kept_up`) are left
out: there the bench measures its own simulation.

:func:`fit_control_plane` fits a result document; ``scripts/fit_control_plane.py`` writes its
:class:`ControlPlaneFit` to ``scenarios/control_plane_fit.json``, which names the result file,
its run's date and commit. The cost model reads that file once
(:data:`~meshpact.core.recovery_costs.CONTROL_PLANE_FIT`): its coefficients are the defaults of
:class:`~meshpact.core.recovery_costs.RecoveryCosts`, which a scenario may override.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass
from enum import Enum
from importlib import resources
from typing import Any, Mapping

__all__ = [
    "Growth",
    "Point",
    "CostFit",
    "FitSource",
    "ControlPlaneFit",
    "fit_growth",
    "fit_control_plane",
    "kept_up",
    "KEPT_UP",
    "load_control_plane_fit",
    "FIT_FILE",
]

FIT_FILE = "control_plane_fit.json"  # in the meshpact.scenarios package (scenarios/)


class Growth(str, Enum):
    """How a cost grows with the ranks N."""

    LINEAR = "linear"  # a + b * N
    LOG2 = "log2"  # a + b * log2 N

    def x(self, ranks: int) -> float:
        n = max(int(ranks), 1)
        return float(n) if self is Growth.LINEAR else math.log2(n)

    def formula(self) -> str:
        return "a + b·N" if self is Growth.LINEAR else "a + b·log2 N"


@dataclass(frozen=True)
class Point:
    """One measured value at ``ranks`` ranks."""

    ranks: int
    value: float


@dataclass(frozen=True)
class CostFit:
    """``intercept + slope * growth.x(N)``, fitted to ``points``; intercept and slope are >= 0."""

    growth: Growth
    intercept: float
    slope: float
    points: tuple[Point, ...]

    def at(self, ranks: int) -> float:
        return self.intercept + self.slope * self.growth.x(ranks)

    def per_rank(self) -> float:
        """The slope per rank (zero unless the form is linear)."""
        return self.slope if self.growth is Growth.LINEAR else 0.0

    def per_log2_rank(self) -> float:
        """The slope per doubling of the ranks (zero unless the form is log2)."""
        return self.slope if self.growth is Growth.LOG2 else 0.0

    def errors(self) -> tuple[float, ...]:
        """The fit's relative error at each measured point: (fit - measured) / measured."""
        return tuple((self.at(p.ranks) - p.value) / p.value for p in self.points)

    def worst_error(self) -> float:
        return max(abs(e) for e in self.errors())

    def to_dict(self) -> dict[str, Any]:
        return {
            "growth": self.growth.value,
            "intercept": self.intercept,
            "slope": self.slope,
            "measured": {str(p.ranks): p.value for p in self.points},
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "CostFit":
        points = tuple(sorted((Point(int(n), float(v)) for n, v in d["measured"].items()), key=lambda p: p.ranks))
        return cls(Growth(d["growth"]), float(d["intercept"]), float(d["slope"]), points)


def _least_squares(points: tuple[Point, ...], growth: Growth) -> tuple[float, float, float]:
    """``(a, b, rms)``: ``a + b x`` minimising the sum of squared relative residuals, ``a >= 0``."""
    w = [1.0 / (p.value * p.value) for p in points]
    x = [growth.x(p.ranks) for p in points]
    y = [p.value for p in points]
    sw = sum(w)
    sx = sum(wi * xi for wi, xi in zip(w, x))
    sy = sum(wi * yi for wi, yi in zip(w, y))
    sxx = sum(wi * xi * xi for wi, xi in zip(w, x))
    sxy = sum(wi * xi * yi for wi, xi, yi in zip(w, x, y))
    det = sw * sxx - sx * sx
    b = (sw * sxy - sx * sy) / det
    a = (sy - b * sx) / sw
    if a < 0:  # no cost is below zero at any size: the best line through the origin instead
        a, b = 0.0, sxy / sxx
    rms = math.sqrt(statistics.fmean(((a + b * xi - yi) / yi) ** 2 for xi, yi in zip(x, y)))
    return a, b, rms


def fit_growth(points: Mapping[int, float] | tuple[Point, ...]) -> CostFit:
    """The better of ``a + b * N`` and ``a + b * log2 N`` over ``points`` (smaller relative residual).

    Needs at least two sizes, every value above zero. A cost that falls as the job grows is no
    cost model: a negative slope in the kept form is refused, naming the points, so a noisy
    run is measured again rather than extrapolated.
    """
    pts = tuple(
        sorted(
            (points if isinstance(points, tuple) else tuple(Point(int(n), float(v)) for n, v in points.items())),
            key=lambda p: p.ranks,
        )
    )
    if len({p.ranks for p in pts}) < 2:
        raise ValueError(f"a fit needs measurements at two sizes or more, got {[p.ranks for p in pts]}")
    if any(not (p.value > 0 and math.isfinite(p.value)) or p.ranks < 1 for p in pts):
        raise ValueError(f"every measured value must be a finite number above zero at 1 rank or more, got {pts}")
    best: tuple[float, Growth, float, float] | None = None
    for growth in Growth:
        a, b, rms = _least_squares(pts, growth)
        if best is None or rms < best[0]:
            best = (rms, growth, a, b)
    assert best is not None
    _, growth, a, b = best
    if b < 0:
        shown = ", ".join(f"{p.ranks}: {p.value:g}" for p in pts)
        raise ValueError(f"the measurements fall as the ranks grow ({shown}); measure again with more repeats")
    return CostFit(growth, a, b, pts)


@dataclass(frozen=True)
class FitSource:
    """The result a fit was made from: its file and its run."""

    file: str
    date: str
    commit: str
    command: str

    def describe(self) -> str:
        return f"{self.file} (`{self.command}`, {self.date}, commit {self.commit})"


@dataclass(frozen=True)
class ControlPlaneFit:
    """The control plane's fitted costs (seconds) and where they were measured."""

    consensus_s: CostFit  # fault known -> every rank holds the decision
    heartbeat_store_s: CostFit  # the store's CPU seconds per round of heartbeat looks
    interval_s: float  # the heartbeat interval the bench ran its looks at
    source: FitSource

    def fits(self) -> dict[str, CostFit]:
        return {"consensus_s": self.consensus_s, "heartbeat_store_s": self.heartbeat_store_s}

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": dict(self.source.__dict__),
            "interval_s": self.interval_s,
            "fits": {k: f.to_dict() for k, f in self.fits().items()},
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ControlPlaneFit":
        fits = d["fits"]
        return cls(
            CostFit.from_dict(fits["consensus_s"]),
            CostFit.from_dict(fits["heartbeat_store_s"]),
            float(d["interval_s"]),
            FitSource(**d["source"]),
        )


# a size is fitted only where its light ranks kept at least this share of the heartbeat's configured look
# rate: where they did not (4,096 threads of Python on two cores look about twice a second, not 20 times),
# every figure of that size measures the simulation's own CPU, not the control plane
KEPT_UP = 0.5


def kept_up(run: Mapping[str, Any], interval_s: float) -> bool:
    """Whether one ``bench/control_scale.py`` run's light ranks kept up enough to be fitted (:data:`KEPT_UP`)."""
    return "error" not in run and float(run.get("looks_achieved_per_rank_per_s") or 0.0) * interval_s >= KEPT_UP


def fit_control_plane(doc: Mapping[str, Any], file: str = "bench/results/control_scale.json") -> ControlPlaneFit:
    """Fit the costs to one ``bench/control_scale.py`` result document (the ring heartbeat's).

    A consensus point is, per size, the median over its runs of ``decision_ms_after_known`` (the
    time from the last rank learning of the fault until the last rank held the decision: the
    consensus stage alone; the bench's own spreading of the news to thousands of light ranks is
    the detection's part, not the consensus'). A heartbeat point is, per run,
    the store's CPU per second of looks over the looks per rank it served that second (the
    light ranks on two cores do not all keep the interval at 1,024, so the CPU per second alone
    would undercount), the median over the repeats. Sizes whose runs all failed, or whose light
    ranks did not keep up (:func:`kept_up`), are left out of both fits.
    """
    if doc.get("watch") != "ring":
        raise ValueError(
            f"{file}: the fit is made from the ring heartbeat's run (watch: ring), got {doc.get('watch')!r}"
        )
    if not any("decision_ms_after_known" in r for runs in doc["runs"].values() for r in runs):
        raise ValueError(f"{file}: no run has decision_ms_after_known; rerun python bench/control_scale.py")
    interval_s = float(doc["interval_s"])
    consensus: dict[int, float] = {}
    for n, runs in doc["runs"].items():
        after = [
            r["decision_ms_after_known"] / 1e3
            for r in runs
            if kept_up(r, interval_s) and r.get("decision_ms_after_known")
        ]
        if after:  # the median over the runs that kept up (the document's own median is over every run)
            consensus[int(n)] = statistics.median(after)
    store: dict[int, float] = {}
    for n, runs in doc["runs"].items():
        per_round = [
            r["server_cpu_s_per_s_heartbeat"] / r["looks_achieved_per_rank_per_s"]
            for r in runs
            if kept_up(r, interval_s)
        ]
        if per_round:
            store[int(n)] = statistics.median(per_round)
    run = doc.get("run") or {}
    source = FitSource(file, str(run.get("date", "")), str(run.get("commit", "")), str(run.get("command", "")))
    return ControlPlaneFit(fit_growth(consensus), fit_growth(store), interval_s, source)


def load_control_plane_fit(path: str | None = None) -> ControlPlaneFit:
    """The fit in ``path``, or the one shipped in the scenarios package (``scenarios/control_plane_fit.json``)."""
    if path is None:
        text = resources.files("meshpact.scenarios").joinpath(FIT_FILE).read_text()
        path = f"scenarios/{FIT_FILE}"
    else:
        with open(path) as f:
            text = f.read()
    try:
        return ControlPlaneFit.from_dict(json.loads(text))
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(
            f"{path}: not a control-plane fit ({type(exc).__name__}: {exc}); "
            f"write it with python scripts/fit_control_plane.py"
        ) from None
