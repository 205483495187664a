"""Selection state: failed ranks from chart clicks and typed ranges, kept across pages.

The failed ranks live in one session key that is not a widget's (:data:`FAILED_KEY`), so
they survive a page switch; the Mesh page's text box shows them as ranges
(:func:`format_ranks`) and reads what the user types exactly (:func:`parse_ranks`:
"5" is rank 5, "5-9, 12" six ranks). Streamlit forgets a widget's value once a page
without it has run, so the pickers that should follow the user (scenario, replay source)
are copied aside and restored by :func:`carry_widget_state`, which the entry point calls
on every run. A click
on the chart arrives as a plotly selection event that Streamlit keeps until the next
selection, so an event must be applied once, not on every rerun: :func:`apply_selection`
compares it with the last one applied. A single clicked rank toggles; a box or lasso
over several ranks fails them all. These functions are pure so they can be tested
without a browser.

The scenario and the failed ranks are also written into the page's link (its query
parameters ``scenario`` and ``failed``, :func:`link_params`), so a reload or a shared link
opens on them; a link's values are read by :func:`scenario_from_link` and
:func:`failed_from_link`, which turn a bad value into one line and the default.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Collection, Iterable, Mapping, MutableMapping

__all__ = [
    "SelectionState",
    "selected_points",
    "ranks_in_event",
    "apply_selection",
    "clamp_failed",
    "parse_ranks",
    "format_ranks",
    "carry_widget_state",
    "FAILED_KEY",
    "KEPT_WIDGETS",
    "KEPT_STORE",
    "LINK_SCENARIO",
    "LINK_FAILED",
    "REPLAY_LINK",
    "replay_source_from_link",
    "replay_link_word",
    "carried_failures_notice",
    "scenario_from_link",
    "failed_from_link",
    "link_params",
]

FAILED_KEY = "failed_ranks"  # sorted list of failed rank ids; not a widget key, so it outlives page switches
# Widget keys whose values follow the user from page to page.
KEPT_WIDGETS = (
    "scenario_source",
    "scenario_builtin",
    "scenario_path",
    "replay_source",
    "replay_recording",
    "replay_path",
    "replay_policy",
)
KEPT_STORE = "meshpact_kept_widgets"


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


_RANKS_HINT = "write rank ids and ranges separated by commas, like 5 or 5-9, 12"


def parse_ranks(text: str, valid: Collection[int]) -> frozenset[int]:
    """The ranks a typed selection names, exactly: ``"5"`` is rank 5 alone, ``"5-9, 12"``
    ranks 5 to 9 and 12 (spaces and a trailing comma are fine; ``5..9`` and ``5–9`` read as
    ranges too). Raises ``ValueError`` with one line saying what was wrong for a token that
    is not a rank or a range, a range written backwards, or a rank not in ``valid``
    (checked on the range ends before the range is built, so no input makes unbounded work).
    """
    out: set[int] = set()
    known = set(valid)
    lo_valid, hi_valid = (min(known), max(known)) if known else (0, -1)
    for raw in text.replace(";", ",").split(","):
        token = raw.strip().replace("..", "-").replace("\u2013", "-").replace(" ", "")
        if not token:
            continue
        first, sep, last = token.partition("-")
        if not first.isdigit() or (sep and not last.isdigit()):
            raise ValueError(f"{raw.strip()!r} is not a rank or a range: {_RANKS_HINT}")
        a, b = int(first), int(last) if sep else int(first)
        if b < a:
            raise ValueError(f"{raw.strip()!r} runs backwards: write the lower rank first ({b}-{a})")
        for end in (a, b):
            if end not in known and not (sep and lo_valid <= end <= hi_valid):
                raise ValueError(f"rank {end} is not in this mesh (ranks {format_ranks(known)})")
        picked = [r for r in range(a, b + 1) if r in known]
        out.update(picked)
    return frozenset(out)


def format_ranks(ranks: Iterable[int]) -> str:
    """Ranks as the shortest text :func:`parse_ranks` reads back: runs of three or more
    consecutive ranks as ``a-b``, the rest one by one (``[1, 2, 3, 7, 8] -> "1-3, 7, 8"``)."""
    rs = sorted({int(r) for r in ranks})
    parts: list[str] = []
    i = 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        if j - i >= 2:
            parts.append(f"{rs[i]}-{rs[j]}")
        else:
            parts.extend(str(r) for r in rs[i : j + 1])
        i = j + 1
    return ", ".join(parts)


def carry_widget_state(
    session: MutableMapping[Any, Any], keys: Iterable[str] = KEPT_WIDGETS, store: str = KEPT_STORE
) -> None:
    """Keep widget values across page switches: a value the session holds is copied aside
    and written back as the session's own (Streamlit ties a widget's value to the page that
    drew it; a value written before the widget is drawn seeds the same key on any page);
    a value the session lost (its page was not drawn in the last run) is put back from the
    copy. Call once at the top of every run, before any widget is drawn."""
    kept = session.get(store)
    if not isinstance(kept, dict):
        kept = {}
    for key in keys:
        if key in session:
            kept[key] = session[key]
        if key in kept:
            session[key] = kept[key]
    session[store] = kept


LINK_SCENARIO, LINK_FAILED = "scenario", "failed"  # the link's query parameters


def scenario_from_link(value: str | None, names: Collection[str]) -> tuple[str | None, str | None]:
    """The built-in scenario a link names, and one line saying why not where it names none of them
    (``(None, None)`` when the link has no scenario)."""
    if value is None or not value.strip():
        return None, None
    name = value.strip()
    if name in names:
        return name, None
    shown = name if len(name) <= 40 else name[:40] + "…"
    return None, (
        f"The link's scenario {shown!r} is not a built-in scenario ({', '.join(sorted(names))}): "
        "the default scenario is shown."
    )


def failed_from_link(text: str | None, valid: Collection[int]) -> tuple[list[int], str | None]:
    """The failed ranks a link names (sorted), or none and one line saying what was wrong."""
    if text is None or not text.strip():
        return [], None
    try:
        return sorted(parse_ranks(text, valid)), None
    except ValueError as exc:
        return [], f"The link's failed ranks are not used: {exc}."


def link_params(scenario: str | None, failed: Iterable[int]) -> dict[str, str]:
    """The query parameters that keep a built-in scenario (``None``: a file, which a link cannot
    carry) and the failed ranks, written as :func:`format_ranks` writes them."""
    out = {}
    if scenario is not None:
        out[LINK_SCENARIO] = scenario
    ranks = format_ranks(failed)
    if ranks:
        out[LINK_FAILED] = ranks
    return out


REPLAY_LINK = "replay"  # the Replay page's query parameter: which source it replays (a short word, kept on reload)
REPLAY_SOURCES = {
    "simulated": "simulated run of this scenario",
    "recording": "recording",
    "mesh": "failures picked on Mesh",
}  # the link's word -> the page's source


def replay_source_from_link(value: str | None) -> str | None:
    """The Replay source a link names (None: none, or a word the page does not know)."""
    return REPLAY_SOURCES.get(value or "")


def replay_link_word(source: str) -> str | None:
    """The link's word for a Replay source (None: not one of the page's)."""
    return next((word for word, s in REPLAY_SOURCES.items() if s == source), None)


def carried_failures_notice(
    picked_on: str | None, scenario: str, failed: Iterable[int], dropped: Iterable[int] = ()
) -> str | None:
    """One line telling the user that the failed ranks picked on scenario ``picked_on`` were carried
    to ``scenario`` (and which were dropped, outside its mesh); None when nothing was carried (the
    same scenario, none picked before, or no failed rank)."""
    kept, lost = sorted(set(failed)), sorted(set(dropped))
    if picked_on is None or picked_on == scenario or not (kept or lost):
        return None
    line = f"Failed ranks carried over from **{picked_on}**: {format_ranks(kept) or 'none'}"
    if lost:
        line += f" ({format_ranks(lost)} dropped: not in this mesh)"
    return line + ". Clear or change them on the Mesh page."
