"""Scenario files: YAML validated against a schema, with errors a person can act on.

A scenario describes a cluster (native domains on hosts, link parameters) and, in the
sections the simulator reads, the workload, faults, checkpointing, recovery policies and
serving settings. :func:`load_scenario` never lets a traceback reach the user: a bad file
raises :class:`ScenarioError` naming the file, the field and what was expected.
"""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path
from typing import Any, Mapping

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .errors import FactError, ScenarioError
from .facts import Domain, LinkClass, LinkParams, Mesh, Vendor

__all__ = [
    "DomainSpec",
    "LinkSpec",
    "ClusterSpec",
    "Scenario",
    "load_scenario",
    "parse_scenario",
    "builtin_scenarios",
    "builtin_scenario_path",
    "default_scenario",
]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


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
                Domain(name=d.name, vendor=d.vendor, host=d.host, ranks=tuple(ranks),
                       backend=d.backend, bridge_rank=d.bridge_rank)
            )
        return Mesh(domains=tuple(domains), links={k: v.params() for k, v in self.links.items()})


class Scenario(_Strict):
    """A whole scenario. The simulator's sections are optional for a mesh-only scenario."""

    model_config = ConfigDict(extra="allow", frozen=True)

    name: str = Field(min_length=1)
    description: str = ""
    cluster: ClusterSpec

    def mesh(self) -> Mesh:
        return self.cluster.mesh()


def _format_errors(source: str, exc: ValidationError) -> str:
    lines = [f"{source}: the scenario does not match the schema:"]
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "(top level)"
        got = err.get("input")
        got_text = "" if isinstance(got, (dict, list)) else f" (got {got!r})"
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown field; check its spelling against the documented fields"
        elif err["type"] == "missing":
            msg = "required field is missing"
        lines.append(f"  - {where}: {msg}{got_text}")
    return "\n".join(lines)


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
