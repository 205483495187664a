"""meshpact.core: the vocabulary every package shares. Pure Python; imports no torch."""

from .errors import FactError, MeshpactError, PlanError, RecordingError, ScenarioError
from .facts import (
    Backend,
    Consumer,
    Domain,
    DType,
    Edge,
    LinkClass,
    LinkParams,
    Mesh,
    ProducerTensor,
    Request,
    Vendor,
)
from .placement import Partial, Placement, Replicate, Shard, parse_placement
from .plan import Plan, PlanCost, Step, StepKind, plan_cost
from .recovery import Policy, RecoveryBreakdown, Stage

__all__ = [
    "MeshpactError",
    "FactError",
    "PlanError",
    "ScenarioError",
    "RecordingError",
    "Backend",
    "Consumer",
    "Domain",
    "DType",
    "Edge",
    "LinkClass",
    "LinkParams",
    "Mesh",
    "ProducerTensor",
    "Request",
    "Vendor",
    "Partial",
    "Placement",
    "Replicate",
    "Shard",
    "parse_placement",
    "Plan",
    "PlanCost",
    "Step",
    "StepKind",
    "plan_cost",
    "Policy",
    "RecoveryBreakdown",
    "Stage",
]
