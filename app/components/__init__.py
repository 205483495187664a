"""Mesh canvas: the Mesh page's chart as a small Streamlit component that answers at once.

The plotly chart re-drew the SVG of the whole figure on every click, because the figure
changed with the selection. This component draws a :class:`~meshpact.app.figures.MeshScene`
on a ``<canvas>`` (``mesh_canvas/index.html`` and ``mesh.js``, plain JavaScript served as
they are, no build step) and paints the selection itself: a click toggles a cell, a drag
draws a box, hovering names the cell, and the pixels change before Python hears of it.
Python gets back a :class:`CanvasPick` (the ids now selected) and sends the selection it
settled on with the scene on the next run; the browser re-reads positions only when the
scene's key changes.

Each pick carries the frame's instance id and a sequence number. :func:`apply_pick` applies
a pick once (Streamlit keeps a component's last value across reruns); the page sends back
the last pick it applied (``ack``) so the browser keeps its own newer clicks instead of
flashing back to an older selection while a rerun is under way.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import streamlit.components.v1 as components

from meshpact.app.figures import MeshScene

__all__ = ["CanvasPick", "Ack", "read_pick", "apply_pick", "mesh_canvas", "FRONTEND"]

FRONTEND = Path(__file__).resolve().parent / "mesh_canvas"
_COMPONENT = components.declare_component("mesh_canvas", path=str(FRONTEND))

Ack = tuple[str, int]
"""The frame instance and sequence number of the last pick applied."""


@dataclass(frozen=True)
class CanvasPick:
    """What the canvas selected: ranks failed (a rank scene) or nodes picked (a node scene)."""

    scene: str  # the key of the scene it was made on
    instance: str  # the browser frame that made it (a new one after a page switch)
    seq: int  # how many picks that frame has made
    ids: frozenset[int]

    @property
    def ack(self) -> Ack:
        return (self.instance, self.seq)


def read_pick(value: Any) -> CanvasPick | None:
    """The component's value as a pick, or None for anything else (no pick yet, a malformed value)."""
    if not isinstance(value, dict):
        return None
    try:
        ids = frozenset(int(i) for i in value["ids"] if not isinstance(i, bool))
        return CanvasPick(str(value["scene"]), str(value["instance"]), int(value["seq"]), ids)
    except (KeyError, TypeError, ValueError):
        return None


def apply_pick(last: Ack | None, pick: CanvasPick | None, scene: str) -> frozenset[int] | None:
    """The ids of ``pick`` if it is new (not the pick ``last`` applied) and was made on
    ``scene``; None when there is nothing to apply (no pick, already applied, or made on a
    scene no longer shown)."""
    if pick is None or pick.ack == last or pick.scene != scene:
        return None
    return pick.ids


def mesh_canvas(
    scene: MeshScene,
    selected: Iterable[int],
    *,
    key: str,
    ack: Ack | None,
    marks: dict[int, int] | None = None,
    height: int = 420,
    caption: str = "",
) -> CanvasPick | None:
    """Draw ``scene`` with ``selected`` ids painted (failed ranks, or picked nodes) and return
    the canvas's last pick. ``marks`` counts failed ranks per node in a node scene;
    ``height`` is the room kept while the frame loads (it then sizes itself)."""
    value = _COMPONENT(
        scene=scene.payload,
        selected=sorted(int(i) for i in selected),
        ack=list(ack) if ack else None,
        marks=[[int(i), int(k)] for i, k in sorted((marks or {}).items())],
        caption=caption,
        height=height,
        key=key,
        default=None,
    )
    return read_pick(value)
