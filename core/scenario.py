"""Scenario files: YAML validated against a schema, with errors a person can act on.

A scenario describes a cluster (native domains on hosts, link parameters) and, in the
sections the simulator reads, the workload, faults, checkpointing, recovery policies and
serving settings. :func:`load_scenario` never lets a traceback reach the user: a bad file
raises :class:`ScenarioError` naming the file, the field and what was expected.
"""

from __future__ import annotations

import difflib
import os
from dataclasses import fields as dataclass_fields
from enum import Enum
from importlib import resources
from pathlib import Path
from typing import Any, Mapping

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, field_validator, model_validator

from .catalog import get_model
from .errors import FactError, ScenarioError
from .fleet import FleetSpec
from .facts import DEFAULT_LINKS, Domain, LinkClass, LinkParams, Mesh, Request, Vendor
from .recovery import Policy, Stage
from .recovery_costs import FaultImpact, FaultScope, RecoveryCosts

__all__ = [
    "SERVING_REQUESTS",
    "Deployment",
    "deployment_of",
    "DomainSpec",
    "LinkSpec",
    "ClusterSpec",
    "ParallelismSpec",
    "WorkloadSpec",
    "ScriptedFault",
    "CheckpointAgeFaults",
    "FaultsSpec",
    "CheckpointMode",
    "CheckpointSpec",
    "RecoverySpec",
    "ServingHostSpec",
    "ServingPreset",
    "SpeculativeSpec",
    "ServingSpec",
    "Scenario",
    "load_scenario",
    "parse_scenario_text",
    "with_overrides",
    "parse_scenario",
    "builtin_scenarios",
    "builtin_scenario_path",
    "default_scenario",
]


# Bounds on what one simulation may be asked to do: a value past these is refused before any
# work starts, naming the field and the limit (an unbounded input must never hang or exhaust memory).
MAX_RANKS = 1 << 20  # 1,048,576 ranks
MAX_DAYS = 3650.0  # ten years of wall clock
MAX_SEED = 2**63 - 1
MAX_SCRIPTED_FAULTS = 100_000


class _Strict(BaseModel):
    # inf and nan are refused everywhere: every number a scenario holds is finite
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class DomainSpec(_Strict):
    name: str = Field(min_length=1, description="e.g. 'cuda@hostA'")
    vendor: Vendor
    host: str = Field(min_length=1)
    ranks: int | list[int] = Field(description="a count (numbered after the previous domain) or explicit rank ids")
    backend: str | None = None
    bridge_rank: int | None = None

    @field_validator("ranks")
    @classmethod
    def _positive(cls, v: int | list[int]) -> int | list[int]:
        if isinstance(v, int) and v <= 0:
            raise ValueError("expected a positive rank count")
        if isinstance(v, list) and not v:
            raise ValueError("expected at least one rank id")
        return v


class LinkSpec(_Strict):
    alpha_s: float = Field(ge=0, description="seconds per message")
    gbit_per_s: float = Field(gt=0, description="bandwidth in Gbit/s")

    def params(self) -> LinkParams:
        return LinkParams(alpha_s=self.alpha_s, beta_s_per_byte=8e-9 / self.gbit_per_s)


class ClusterSpec(_Strict):
    domains: list[DomainSpec] = Field(min_length=1)
    links: dict[LinkClass, LinkSpec] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _mesh_is_valid(self) -> "ClusterSpec":
        try:
            self.mesh()
        except FactError as exc:
            raise ValueError(str(exc)) from None
        return self

    def mesh(self) -> Mesh:
        domains, next_rank = [], 0
        for d in self.domains:
            ranks = list(range(next_rank, next_rank + d.ranks)) if isinstance(d.ranks, int) else d.ranks
            next_rank = max(ranks) + 1
            domains.append(
                Domain(
                    name=d.name,
                    vendor=d.vendor,
                    host=d.host,
                    ranks=tuple(ranks),
                    backend=d.backend,  # type: ignore[arg-type]  # Domain.__post_init__ reads a backend's name too
                    bridge_rank=d.bridge_rank,
                )
            )
        return Mesh(domains=tuple(domains), links={k: v.params() for k, v in self.links.items()})


def _model_name(v: str) -> str:
    try:
        get_model(v)
    except FactError as exc:
        raise ValueError(str(exc)) from None
    return v


class ParallelismSpec(_Strict):
    """Model parallelism inside one data-parallel replica; the replica is tensor x pipeline ranks."""

    tensor: int = Field(1, ge=1)
    pipeline: int = Field(1, ge=1)

    @property
    def replica_ranks(self) -> int:
        return self.tensor * self.pipeline


class WorkloadSpec(_Strict):
    """What trains, how long a step takes, and for how long the job runs.

    The step time is either given (``step_seconds``) or derived from a cost model:
    ``6 * active parameters * tokens_per_step / (ranks * peak_tflops_per_rank * mfu)``
    (6 FLOPs per parameter per token for forward and backward: Kaplan et al. 2020,
    "Scaling Laws for Neural Language Models").
    """

    model: str = "qwen3-14b"
    parallelism: ParallelismSpec = ParallelismSpec()
    step_seconds: float | None = Field(None, gt=0, le=86400.0, description="seconds per optimizer step")
    tokens_per_step: int | None = Field(None, gt=0, le=10**13, description="global batch in tokens (cost model)")
    peak_tflops_per_rank: float = Field(989.0, gt=0, description="dense BF16; 989 is the H100 SXM datasheet value")
    mfu: float = Field(0.4, gt=0, le=1, description="model FLOPs utilisation (cost model)")
    state_bytes_per_param: float = Field(
        16.0, gt=0, description="bf16 weights and grads plus fp32 Adam state: 2+2+12 (ZeRO, Rajbhandari et al. 2020)"
    )
    days: float = Field(1.0, gt=0, le=MAX_DAYS, description="wall-clock days the job runs (the horizon)")
    work_steps: int | None = Field(
        None, ge=1, le=10**12, description="run until this many steps are committed (days is then the limit)"
    )
    step_time_cv: float = Field(
        0.0, ge=0, le=1, description="stragglers: coefficient of variation of one rank's step time, per step"
    )
    ranks: int | None = Field(
        None, ge=1, le=MAX_RANKS, description="ranks simulated; default: the cluster's world size"
    )

    _model = field_validator("model")(_model_name)

    @model_validator(mode="after")
    def _one_step_time(self) -> "WorkloadSpec":
        if self.step_seconds is not None and self.tokens_per_step is not None:
            raise ValueError("give step_seconds or tokens_per_step (the cost model), not both")
        return self


class ScriptedFault(_Strict):
    at_s: float = Field(ge=0, le=MAX_DAYS * 86400.0, description="seconds after the start")
    impact: FaultImpact = FaultImpact.TRANSIENT
    rank: int = Field(0, ge=0, le=MAX_RANKS)
    scope: FaultScope = Field(FaultScope.RANK, description="rank, node or rack (the node or rack holding rank)")


class CheckpointAgeFaults(_Strict):
    """Faults placed by checkpoint age: in each of the first ``count`` checkpoint intervals
    (the start counts as a checkpoint), one fault exactly ``steps`` steps after it. Each
    policy meets them at its own times, at the same age (AccelPact's experiment)."""

    steps: int = Field(ge=1, le=10**9, description="checkpoint age at the fault, in steps")
    count: int = Field(ge=1, le=MAX_SCRIPTED_FAULTS, description="faults, one per checkpoint interval")
    impact: FaultImpact = FaultImpact.TRANSIENT
    rank: int = Field(0, ge=0, le=MAX_RANKS)


class FaultsSpec(_Strict):
    """Faults: a Poisson process per rank (superposed at cluster rate), or scripted events.

    A lost rank may take its node or its rack with it (``node_fraction``,
    ``rack_fraction`` of rank losses); ranks are numbered node by node, rack by rack. Lost
    ranks are replaced from a warm spare pool when it holds enough ranks (the failed
    hardware returns to the pool after ``repair_hours``), else from the scheduler.
    """

    rank_mtbf_hours: float | None = Field(None, gt=0, description="per-rank MTBF of transient communication faults")
    rank_loss_mtbf_hours: float | None = Field(None, gt=0, description="per-rank MTBF of losing the rank")
    hang_mtbf_hours: float | None = Field(
        None, gt=0, description="per-rank MTBF of hangs (no error; found by a timeout)"
    )
    ranks_per_node: int = Field(8, ge=1, le=1024, description="accelerators on one node")
    nodes_per_rack: int = Field(4, ge=1, le=1024, description="nodes behind one rack switch (assumed 4)")
    node_fraction: float = Field(0.0, ge=0, le=1, description="fraction of rank losses that take the whole node")
    rack_fraction: float = Field(0.0, ge=0, le=1, description="fraction of rank losses that take the whole rack")
    spare_ranks: int = Field(0, ge=0, le=MAX_RANKS, description="warm spare ranks that replace lost ones")
    repair_hours: float = Field(4.0, gt=0, le=87600.0, description="until a lost rank's replica rejoins (excise)")
    rejoin_s: float = Field(
        60.0, ge=0, le=MAX_DAYS * 86400.0, description="until a replica excised for a transient fault rejoins"
    )
    scripted: list[ScriptedFault] = Field(default_factory=list, max_length=MAX_SCRIPTED_FAULTS)
    at_checkpoint_age: CheckpointAgeFaults | None = None
    seed: int = Field(0, ge=0, le=MAX_SEED, description="seed of the random fault process")

    @model_validator(mode="after")
    def _fractions(self) -> "FaultsSpec":
        if self.node_fraction + self.rack_fraction > 1:
            raise ValueError("node_fraction + rack_fraction: expected at most 1 (they split the rank losses)")
        return self


class CheckpointMode(str, Enum):
    SYNC = "sync"  # training waits for the write to storage
    ASYNC = "async"  # training waits for a snapshot to host memory; the write runs behind it


class CheckpointSpec(_Strict):
    every_steps: int = Field(500, ge=1, le=10**12, description="steps between checkpoints")
    mode: CheckpointMode = CheckpointMode.SYNC
    seconds: float | None = Field(
        None, ge=0, le=86400.0, description="write time; default: shard bytes / write bandwidth"
    )
    write_gbyte_per_s_per_rank: float = Field(1.0, gt=0, le=10_000)
    read_gbyte_per_s_per_rank: float | None = Field(
        None,
        gt=0,
        le=10_000,
        description="checkpoint reload bandwidth; default: recovery.costs.checkpoint_read_bytes_per_s",
    )
    snapshot_gbyte_per_s_per_rank: float = Field(25.0, gt=0, description="device to pinned host memory (async)")
    host_memory_gib_per_rank: float = Field(64.0, gt=0, description="host memory available for async snapshots")


_RECOVERY_COST_FIELDS: dict[str, Any] = {
    f.name: (float, Field(f.default, ge=0, le=1e15)) for f in dataclass_fields(RecoveryCosts)
}
RecoveryCostsSpec = create_model(  # the fields of core.recovery_costs.RecoveryCosts, one source of truth
    "RecoveryCostsSpec",
    __base__=_Strict,
    **_RECOVERY_COST_FIELDS,
)


class RecoverySpec(_Strict):
    """Policies to compare, cost-model parameters, and fixed stage durations per policy."""

    policies: list[Policy] = Field(default_factory=lambda: list(Policy), min_length=1)
    costs: RecoveryCostsSpec = Field(default_factory=RecoveryCostsSpec)
    stage_seconds: dict[Policy, dict[Stage, float]] = Field(
        default_factory=dict, description="fixed durations that replace the model's, e.g. measured ones"
    )

    @field_validator("stage_seconds")
    @classmethod
    def _stages(cls, v: dict[Policy, dict[Stage, float]]) -> dict[Policy, dict[Stage, float]]:
        for policy, stages in v.items():
            if Stage.REPLAY in stages:
                raise ValueError(f"{policy.value}.replay: replay follows from lost steps; it cannot be fixed")
            bad = {s.value: x for s, x in stages.items() if x < 0}
            if bad:
                raise ValueError(f"{policy.value}: stage durations must be >= 0 seconds, got {bad}")
        return v

    def recovery_costs(self, source: str = "scenario") -> RecoveryCosts:
        try:
            return RecoveryCosts(**self.costs.model_dump())
        except ValueError as exc:
            raise ScenarioError(f"{source}: recovery.costs: {exc}") from None


class ServingHostSpec(_Strict):
    """One host of the serving pair: how many sequences it decodes at once and how fast."""

    vendor: Vendor
    slots: int = Field(ge=1, description="sequences decoded concurrently")
    per_token_s: float = Field(gt=0, description="decode time of one token of one sequence")
    prefill_s: float = Field(0.0, ge=0, description="time before the first token")


class ServingPreset(_Strict):
    model: str
    local: ServingHostSpec
    remote: ServingHostSpec
    notes: str = ""

    _model = field_validator("model")(_model_name)


class SpeculativeSpec(_Strict):
    """Speculative decoding: a draft proposes gamma tokens, the target verifies in one pass."""

    gamma: int = Field(ge=1, description="draft lookahead")
    alpha: float = Field(ge=0, lt=1, description="acceptance rate of one draft token")
    draft_cost_ratio: float = Field(ge=0, description="draft token time / target pass time")


# The requests the serving deployments (simulated and live) implement: the result requests of one LM head.
class Deployment(str, Enum):
    """How the two serving hosts share the work (live spillover and the simulator alike)."""

    REQUESTS = "requests"  # whole requests spill to host 2 once host 1's slots are full
    MODEL = "model"  # the model split by layers: every decode step crosses the link


def deployment_of(value: str) -> "Deployment":
    """``value`` as a :class:`Deployment`, or a :class:`ScenarioError` naming the choices."""
    try:
        return Deployment(value)
    except ValueError:
        raise ScenarioError(
            f"--deployment {value!r}: expected one of {', '.join(d.value for d in Deployment)}"
        ) from None


SERVING_REQUESTS: tuple[Request, ...] = (Request.FULL, Request.LOGPROB, Request.TOKEN, Request.OWNER_TOKEN)


class ServingSpec(_Strict):
    model: str = Field("dense", description="a key of presets")
    presets: dict[str, ServingPreset] = Field(min_length=1)
    concurrency: int = Field(8, ge=1, le=100_000, description="clients, each with one request in flight")
    arrival_rate_per_s: float | None = Field(None, gt=0, description="open-loop Poisson arrivals instead")
    request: Request = Request.TOKEN
    output_tokens: int = Field(128, ge=1, le=1_000_000)
    requests: int = Field(200, ge=1, le=1_000_000, description="requests to complete")
    consumer_ranks: int = Field(1, ge=1, description="consumer ranks on the local host")
    producer_ranks: int = Field(1, ge=1, description="remote ranks holding the LM head (vocab-sharded when > 1)")
    link: LinkSpec | None = Field(None, description="default: the cluster's ethernet link")
    speculative: SpeculativeSpec | None = None
    seed: int = 0

    @field_validator("request")
    @classmethod
    def _request(cls, v: Request) -> Request:
        if v not in SERVING_REQUESTS:
            raise ValueError(f"expected one of {[r.value for r in SERVING_REQUESTS]}")
        return v

    @model_validator(mode="after")
    def _known_preset(self) -> "ServingSpec":
        if self.model not in self.presets:
            raise ValueError(f"model {self.model!r} is not a preset; expected one of {sorted(self.presets)}")
        return self

    def preset(self) -> ServingPreset:
        return self.presets[self.model]


class Scenario(_Strict):
    """A whole scenario. The simulator's sections are optional for a mesh-only scenario.

    Unknown top-level sections are allowed (other tools may add their own) unless the name
    is a near-miss of a known section, which is refused as a likely misspelling.
    """

    model_config = ConfigDict(extra="allow", frozen=True)

    name: str = Field(min_length=1)
    description: str = ""
    cluster: ClusterSpec
    workload: WorkloadSpec = Field(default_factory=WorkloadSpec)
    faults: FaultsSpec = Field(default_factory=FaultsSpec)
    checkpointing: CheckpointSpec = Field(default_factory=CheckpointSpec)
    recovery: RecoverySpec = Field(default_factory=RecoverySpec)
    serving: ServingSpec | None = None
    fleet: FleetSpec | None = Field(None, description="the servers the job draws from (AIReSim's cluster model)")

    @model_validator(mode="before")
    @classmethod
    def _no_misspelt_sections(cls, data: Any) -> Any:
        if isinstance(data, Mapping):
            known = list(cls.model_fields)
            for key in data:
                if key not in known:
                    near = difflib.get_close_matches(str(key), known, n=1, cutoff=0.75)
                    if near:
                        raise ValueError(f"unknown section {key!r}; did you mean {near[0]!r}?")
        return data

    def mesh(self) -> Mesh:
        return self.cluster.mesh()

    def link(self, cls_: LinkClass = LinkClass.ETHERNET) -> LinkParams:
        """α-β parameters of one link class: the cluster's, else the documented default."""
        spec = self.cluster.links.get(cls_)
        return spec.params() if spec else DEFAULT_LINKS[cls_]


def with_overrides(scenario: Scenario, overrides: Mapping[str, Any], source: str = "override") -> Scenario:
    """A copy of ``scenario`` with dotted fields replaced (``checkpointing.every_steps``), re-validated.

    A path that names no field, or a value the schema refuses, raises :class:`ScenarioError`
    naming the path and what was expected.
    """
    data = scenario.model_dump(mode="json", exclude_unset=False)
    for path, value in overrides.items():
        parts = path.split(".")
        node: Any = data
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            if not isinstance(node, dict):
                raise ScenarioError(f"{source}: {path}: {'.'.join(parts[:i])} is not a section with fields")
            top_unknown = i == 0 and part not in type(scenario).model_fields and part not in node
            if top_unknown or (part not in node and not (last or _section_may_hold(parts[: i + 1]))):
                raise ScenarioError(f"{source}: {path}: no field {part!r}; expected one of {sorted(node)}")
            if last:
                node[part] = value
            else:
                if node.get(part) is None:
                    node[part] = {}
                node = node[part]
    return parse_scenario(data, source)


def _section_may_hold(parts: list[str]) -> bool:
    """Mappings keyed by name may gain keys: ``recovery.stage_seconds.<policy>.<stage>``."""
    return parts[0] in ("recovery",) and len(parts) <= 3


def _format_errors(source: str, exc: ValidationError) -> str:
    """Every schema error on one line: ``file: field: problem (got value); field: ...``."""
    lines: list[str] = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "(top level)"
        got = err.get("input")
        got_text = "" if isinstance(got, (dict, list)) else f" (got {got!r})"
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown field; check its spelling against the documented fields"
        elif err["type"] == "missing":
            msg = "required field is missing"
        lines.append(f"{where}: {msg}{got_text}")
    return f"{source}: " + "; ".join(lines)


def parse_scenario(data: Any, source: str = "<scenario>", model: type[Scenario] = Scenario) -> Scenario:
    if not isinstance(data, Mapping):
        raise ScenarioError(f"{source}: expected a YAML mapping with 'name' and 'cluster' at the top")
    try:
        return model.model_validate(dict(data))
    except ValidationError as exc:
        raise ScenarioError(_format_errors(source, exc)) from None


def load_scenario(path: str | os.PathLike[str], model: type[Scenario] = Scenario) -> Scenario:
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ScenarioError(f"{p}: no such scenario file") from None
    except (IsADirectoryError, UnicodeDecodeError) as exc:
        raise ScenarioError(f"{p}: cannot read a YAML scenario ({exc})") from None
    return parse_scenario_text(text, str(p), model)


def parse_scenario_text(text: str, source: str, model: type[Scenario] = Scenario) -> Scenario:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ScenarioError(f"{source}: not valid YAML{where}: {getattr(exc, 'problem', exc)}") from None
    return parse_scenario(data, source, model)


def builtin_scenarios() -> list[str]:
    """Names of the scenarios shipped in ``scenarios/``."""
    root = resources.files("meshpact.scenarios")
    return sorted(p.name[: -len(".yaml")] for p in root.iterdir() if p.name.endswith(".yaml"))


def builtin_scenario_path(name: str) -> Path:
    root = resources.files("meshpact.scenarios")
    path = Path(str(root.joinpath(f"{name}.yaml")))
    if not path.exists():
        raise ScenarioError(f"no built-in scenario {name!r}; known: {', '.join(builtin_scenarios())}")
    return path


def default_scenario(model: type[Scenario] = Scenario) -> Scenario:
    """The 32-rank, two-domain, two-host cluster the dashboard opens with."""
    return load_scenario(builtin_scenario_path("default"), model)
