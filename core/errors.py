"""User-facing errors.

Every mistake a user can make (a bad scenario file, a malformed fact, an unknown edge,
a plan that fails its check) raises a :class:`MeshpactError` whose message names what was
wrong and what was expected. The CLI and the dashboard print the message, never a
traceback.
"""

from __future__ import annotations

__all__ = ["MeshpactError", "FactError", "PlanError", "ScenarioError", "RecordingError"]


class MeshpactError(Exception):
    """An error caused by input, reported to the user as its message alone."""


class FactError(MeshpactError):
    """A fact (mesh, tensor, consumer, placement) is malformed."""


class PlanError(MeshpactError):
    """A plan is malformed, or was refused because it failed its check."""


class ScenarioError(MeshpactError):
    """A scenario file does not match the schema."""


class RecordingError(MeshpactError):
    """A recording cannot be read or written."""
