"""Selection state: from clicks on the mesh chart and the rank multiselect to failed ranks.

The Mesh page keeps the failed ranks in one place, the rank multiselect's value. A click
on the chart arrives as a plotly selection event that Streamlit keeps until the next
selection, so an event must be applied once, not on every rerun: :func:`apply_selection`
compares it with the last one applied. A single clicked rank toggles; a box or lasso
over several ranks fails them all. These functions are pure so they can be tested
without a browser.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping

__all__ = ["SelectionState", "selected_points", "ranks_in_event", "apply_selection", "clamp_failed"]


@dataclass(frozen=True)
class SelectionState:
    """The failed ranks and the selection event last applied to them."""

    failed: frozenset[int] = frozenset()
    last_selection: frozenset[tuple[int, int, int]] = frozenset()

    @property
    def sorted_failed(self) -> list[int]:
        return sorted(self.failed)


def _rank_of(point: Mapping[str, Any]) -> int | None:
    data = point.get("customdata")
    if isinstance(data, (list, tuple)):
        data = data[0] if data else None
    if data is None or isinstance(data, bool):
        return None
    try:
        return int(data)
    except (TypeError, ValueError):
        return None


def selected_points(event: Any) -> frozenset[tuple[int, int, int]]:
    """``(curve, point, rank)`` of every rank point in a plotly selection event.

    ``customdata`` holds the rank. Points of line traces (rings, bridges) carry no rank
    and are ignored, as is an event of any other shape (``None`` before the first click).
    The curve and point numbers tell apart two clicks on the same rank: once failed, a
    rank is drawn in another trace.
    """
    if event is None:
        return frozenset()
    selection = event.get("selection") if isinstance(event, Mapping) else getattr(event, "selection", None)
    if not isinstance(selection, Mapping):
        return frozenset()
    out = set()
    for p in selection.get("points") or []:
        if not isinstance(p, Mapping):
            continue
        rank = _rank_of(p)
        if rank is not None:
            out.add((int(p.get("curve_number") or 0), int(p.get("point_index") or 0), rank))
    return frozenset(out)


def ranks_in_event(event: Any) -> frozenset[int]:
    """Rank ids of the points in a plotly selection event."""
    return frozenset(r for _, _, r in selected_points(event))


def apply_selection(state: SelectionState, multiselect: Iterable[int], event: Any) -> SelectionState:
    """The next state after a rerun.

    ``multiselect`` is what the rank multiselect holds now (the user may have edited it);
    ``event`` is the chart's selection event. A new event of one rank toggles that rank;
    a new event of several ranks (box or lasso) marks them all failed; an event equal to
    the last one applied changes nothing; an emptied selection only resets the memory, so
    clicking the same rank again toggles it again.
    """
    failed = frozenset(int(r) for r in multiselect)
    points = selected_points(event)
    if points == state.last_selection:
        return SelectionState(failed, state.last_selection)
    selected = frozenset(r for _, _, r in points)
    if len(selected) == 1:
        failed = failed ^ selected
    elif selected:
        failed = failed | selected
    return SelectionState(failed, points)


def clamp_failed(failed: Iterable[int], ranks: Iterable[int]) -> list[int]:
    """Failed ranks that exist in the current mesh, sorted (a new scenario may be smaller)."""
    known = set(ranks)
    return sorted({int(r) for r in failed if int(r) in known})

