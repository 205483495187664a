"""The fleet: the servers a training job draws from, how they fail and how they are repaired.

A job runs on ``job_servers`` servers chosen from a working pool, with ``warm_standbys``
more held beside it; a spare pool lends servers at a preemption cost when the working pool
runs short. A fraction of the servers are systematically bad and fail at a multiple of the
base rate on top of it; times to failure are exponential, Weibull or lognormal, each with
the mean of the exponential. A failed server goes to automatic repair, and with some
probability on to manual repair; either may report success without fixing the fault.
Diagnosis may miss (the server returns unrepaired) or blame the wrong server. A retirement
policy may take servers out for good. This is the cluster model of AIReSim (Lin,
Pattabiraman, Patel, arXiv 2603.07041, 2026), whose Table 1 values are the defaults here;
:data:`AIRESIM_FIELDS` maps AIReSim's parameter names (minutes, failures per minute) onto
these fields (minutes, failures per server-day).

:func:`fleet_from_airesim` reads an AIReSim parameter file (YAML or JSON) and refuses an
unknown field or an out-of-range value in one line naming it.
"""

from __future__ import annotations

import json
from enum import Enum
from pathlib import Path
from typing import Any, Mapping

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .errors import ScenarioError

__all__ = [
    "FailureDistribution",
    "HostSelection",
    "Retirement",
    "RetirementSpec",
    "FleetSpec",
    "AIRESIM_FIELDS",
    "AIRESIM_IGNORED",
    "fleet_from_airesim",
    "parse_fleet",
]

MAX_SERVERS = 1 << 20
MINUTES_PER_DAY = 1440.0


class FailureDistribution(str, Enum):
    """The law of one server's time to failure; all three have mean ``1 / rate``."""

    EXPONENTIAL = "exponential"
    WEIBULL = "weibull"  # shape k: k < 1 infant mortality, k > 1 wear-out
    LOGNORMAL = "lognormal"  # sigma: the spread of the log


class HostSelection(str, Enum):
    """Which servers a host selection gives the job (the job's servers, then its standbys)."""

    POOL_ORDER = "pool_order"  # the servers longest in the working pool, roles shuffled (AIReSim's default)
    RANDOM = "random"  # uniform over the working pool
    FEWEST_FAILURES = "fewest_failures"  # fewest failures so far first, ties at random


class Retirement(str, Enum):
    """When a repaired server is taken out of the fleet for good."""

    NEVER = "never"
    THRESHOLD = "threshold"  # max_failures or more in the last window_days
    SCORE = "score"  # a score that failures lower and healthy days raise falls to the threshold


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class RetirementSpec(_Strict):
    policy: Retirement = Retirement.NEVER
    max_failures: int = Field(5, ge=1, le=10**6, description="threshold: failures in the window that retire")
    window_days: float = Field(7.0, gt=0, le=3650, description="threshold: the window")
    initial_score: float = Field(100.0, ge=-1e12, le=1e12, description="score: every server's start")
    failure_penalty: float = Field(30.0, ge=0, le=1e12, description="score: taken per failure blamed")
    success_credit: float = Field(10.0, ge=0, le=1e12, description="score: given per whole healthy period of a run")
    success_period_days: float = Field(1.0, ge=0, le=3650, description="score: the period (0: every run earns one)")
    retire_at_or_below: float = Field(0.0, ge=-1e12, le=1e12, description="score: the threshold")


class FleetSpec(_Strict):
    """One job on a fleet of servers (AIReSim's cluster model; defaults are its Table 1)."""

    job_servers: int = Field(4096, ge=1, le=MAX_SERVERS, description="servers the job runs on")
    warm_standbys: int = Field(16, ge=0, le=MAX_SERVERS, description="servers held beside the job to swap in")
    working_pool: int = Field(4160, ge=1, le=MAX_SERVERS, description="servers in the working pool")
    spare_pool: int = Field(
        200, ge=0, le=MAX_SERVERS, description="servers lent by other work, at preemption_minutes each"
    )
    work_days: float = Field(256.0, gt=0, le=3650, description="the job's length without failures")
    failures_per_server_day: float = Field(0.01, ge=0, le=1000, description="base failure rate of a good server")
    bad_fraction: float = Field(0.15, ge=0, le=1, description="servers that are systematically bad at the start")
    bad_multiplier: float = Field(5.0, ge=0, le=1e6, description="a bad server fails at (1 + this) x the base rate")
    bad_regeneration_days: float | None = Field(
        None, gt=0, le=3650, description="every so many days a tenth of bad_fraction of the good servers turns bad"
    )
    distribution: FailureDistribution = FailureDistribution.EXPONENTIAL
    weibull_shape: float = Field(1.0, gt=0, le=100)
    lognormal_sigma: float = Field(1.0, gt=0, le=10)
    recovery_minutes: float = Field(20.0, ge=0, le=1e6, description="the job's recovery after a failure (cold restart)")
    host_selection_minutes: float = Field(3.0, ge=0, le=1e6, description="a host selection before the job restarts")
    preemption_minutes: float = Field(20.0, ge=0, le=1e6, description="to take one server from the spare pool")
    auto_repair_minutes: float = Field(120.0, ge=0, le=1e7, description="mean automatic repair (exponential)")
    manual_repair_minutes: float = Field(2880.0, ge=0, le=1e7, description="mean manual repair (exponential)")
    escalate_probability: float = Field(0.8, ge=0, le=1, description="automatic repair passes the server to manual")
    auto_false_success: float = Field(0.4, ge=0, le=1, description="automatic repair reports success, fault remains")
    manual_false_success: float = Field(0.2, ge=0, le=1, description="manual repair reports success, fault remains")
    diagnosis_probability: float = Field(1.0, ge=0, le=1, description="a failure sends a server to repair at all")
    diagnosis_uncertainty: float = Field(0.0, ge=0, le=1, description="a diagnosed failure blames the wrong server")
    host_selection: HostSelection = HostSelection.POOL_ORDER
    retirement: RetirementSpec = Field(default_factory=RetirementSpec)
    ranks_per_server: int = Field(
        8, ge=1, le=1024, description="ranks (accelerators) per server, for the policies' costs"
    )

    @model_validator(mode="after")
    def _pool_holds_the_job(self) -> "FleetSpec":
        need = self.job_servers + self.warm_standbys
        if self.working_pool < need:
            raise ValueError(
                f"working_pool {self.working_pool} is smaller than job_servers + warm_standbys = {need}; "
                "expected a working pool at least that large"
            )
        return self

    @property
    def needed(self) -> int:
        """Servers a full host selection takes: the job's and its standbys."""
        return self.job_servers + self.warm_standbys

    @property
    def servers(self) -> int:
        return self.working_pool + self.spare_pool


# AIReSim's parameter name -> (field here, factor from AIReSim's unit to this field's).
AIRESIM_FIELDS: Mapping[str, tuple[str, float | None]] = {
    "job_size": ("job_servers", None),
    "warm_standbys": ("warm_standbys", None),
    "working_pool_size": ("working_pool", None),
    "spare_pool_size": ("spare_pool", None),
    "job_length": ("work_days", 1.0 / MINUTES_PER_DAY),
    "random_failure_rate": ("failures_per_server_day", MINUTES_PER_DAY),
    "systematic_failure_fraction": ("bad_fraction", None),
    "systematic_failure_rate_multiplier": ("bad_multiplier", None),
    "bad_server_regen_interval": ("bad_regeneration_days", 1.0 / MINUTES_PER_DAY),
    "failure_distribution": ("distribution", None),
    "weibull_shape": ("weibull_shape", None),
    "lognormal_sigma": ("lognormal_sigma", None),
    "recovery_time": ("recovery_minutes", None),
    "host_selection_time": ("host_selection_minutes", None),
    "preemption_wait_time": ("preemption_minutes", None),
    "auto_repair_time": ("auto_repair_minutes", None),
    "manual_repair_time": ("manual_repair_minutes", None),
    "prob_auto_to_manual": ("escalate_probability", None),
    "auto_repair_fail_prob": ("auto_false_success", None),
    "manual_repair_fail_prob": ("manual_false_success", None),
    "diagnosis_probability": ("diagnosis_probability", None),
    "diagnosis_uncertainty": ("diagnosis_uncertainty", None),
}
# AIReSim's run-control names: accepted and not used (the stopping rule here is its own).
AIRESIM_IGNORED = frozenset(
    {"seed", "num_replications", "adaptive_replications", "confidence_level", "relative_accuracy", "max_replications"}
)


def _fmt_errors(
    source: str, exc: ValidationError, names: Mapping[str, str] | None = None, given: Mapping[str, Any] | None = None
) -> str:
    """Every error on one line; ``names`` and ``given`` put back a foreign file's names and values."""
    parts = []
    for err in exc.errors():
        loc = [str(p) for p in err["loc"]]
        got = err.get("input")
        if loc and names and loc[0] in names:
            got = (given or {}).get(names[loc[0]], got)
            loc[0] = names[loc[0]]
        where = ".".join(loc)
        got_text = "" if isinstance(got, (dict, list)) else f" (got {got!r})"
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown field; check its spelling against the documented fields"
        parts.append(f"{where}: {msg}{got_text}" if where else f"{msg}{got_text}")
    return f"{source}: " + "; ".join(parts)


def parse_fleet(data: Any, source: str = "fleet") -> FleetSpec:
    """``data`` (a mapping of this module's field names) as a :class:`FleetSpec`, or one line naming what is wrong."""
    if not isinstance(data, Mapping):
        raise ScenarioError(f"{source}: expected a mapping of fleet fields")
    try:
        return FleetSpec.model_validate(dict(data))
    except ValidationError as exc:
        raise ScenarioError(_fmt_errors(source, exc)) from None


def fleet_from_airesim(path: str | Path) -> FleetSpec:
    """An AIReSim parameter file (YAML or JSON, AIReSim's names and units) as a :class:`FleetSpec`.

    A missing ``bad_server_regeneration`` or a false one leaves regeneration off, whatever
    the interval says, as in AIReSim.
    """
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ScenarioError(f"{p}: cannot read an AIReSim parameter file ({exc.__class__.__name__})") from None
    try:
        data = json.loads(text) if p.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise ScenarioError(
            f"{p}: not valid {'JSON' if p.suffix == '.json' else 'YAML'}: {getattr(exc, 'problem', None) or exc}"
        ) from None
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ScenarioError(f"{p}: expected a mapping of AIReSim parameter names")
    known = set(AIRESIM_FIELDS) | AIRESIM_IGNORED | {"bad_server_regeneration"}
    unknown = sorted(str(k) for k in data if k not in known)
    if unknown:
        raise ScenarioError(
            f"{p}: unknown AIReSim parameter {unknown[0]!r}; expected AIReSim's names "
            f"({', '.join(sorted(AIRESIM_FIELDS))} or bad_server_regeneration)"
        )
    regen = data.get("bad_server_regeneration", False)
    if not isinstance(regen, bool):
        raise ScenarioError(f"{p}: bad_server_regeneration: expected true or false (got {regen!r})")
    out: dict[str, Any] = {}
    names: dict[str, str] = {}
    for name, value in data.items():
        if name not in AIRESIM_FIELDS:
            continue
        field, factor = AIRESIM_FIELDS[name]
        names[field] = name
        if field == "bad_regeneration_days" and not regen:
            continue
        if factor is not None:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ScenarioError(f"{p}: {name}: expected a number (got {value!r})")
            value = value * factor
        out[field] = value
    if regen and "bad_regeneration_days" not in out:
        out["bad_regeneration_days"] = 30.0  # AIReSim's default interval
    pool, job, standbys = (
        out.get(k, FleetSpec.model_fields[k].default) for k in ("working_pool", "job_servers", "warm_standbys")
    )
    if all(isinstance(v, int) and not isinstance(v, bool) for v in (pool, job, standbys)) and pool < job + standbys:
        raise ScenarioError(
            f"{p}: working_pool_size {pool} is smaller than job_size + warm_standbys = {job + standbys}; "
            "expected a working pool at least that large"
        )
    try:
        return FleetSpec.model_validate(out)
    except ValidationError as exc:
        raise ScenarioError(_fmt_errors(str(p), exc, names, data)) from None
