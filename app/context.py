"""Dashboard context: the scenario picker and the cached values every page shares.

The sidebar (drawn by :func:`require_scenario`, which every page calls first) offers
the built-in scenarios, an uploaded YAML file or a path on disk. The
chosen scenario is parsed once per distinct text (``st.cache_data``); its mesh and
drawing positions are shared handles (``st.cache_resource``). A file that does not
parse or does not match the schema shows its :class:`ScenarioError` message on the page
instead of a traceback, and the page stops there. The built-in scenario and the failed
ranks live in the page's link as well (``?scenario=whatif_1024&failed=5,600-603``): a
reload or a shared link opens on them, and a value of the link that cannot be used is
one line on the page and the default.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import streamlit as st

from meshpact.app.state import (
    FAILED_KEY,
    LINK_FAILED,
    LINK_SCENARIO,
    carried_failures_notice,
    clamp_failed,
    failed_from_link,
    link_params,
    scenario_from_link,
)
from meshpact.core.errors import MeshpactError, ScenarioError
from meshpact.core.facts import Mesh
from meshpact.core.mesh import rank_positions
from meshpact.core.scenario import Scenario, builtin_scenario_path, builtin_scenarios, parse_scenario_text

__all__ = [
    "ScenarioChoice",
    "scenario_sidebar",
    "require_scenario",
    "mesh_of",
    "positions_of",
    "mesh_for",
    "positions_for",
    "SCENARIO_KEY",
    "message_markdown",
    "keep_in_link",
]

SCENARIO_KEY = "meshpact_scenario"
ERROR_KEY = "meshpact_scenario_error"
LINK_READ_KEY = "meshpact_link_read"  # this session has opened on what its link names
LINK_PROBLEMS_KEY = "meshpact_link_problems"  # one line per value of the link that could not be used
SOURCES = ("built-in", "upload", "path")
MAX_SCENARIO_BYTES = 4 << 20  # a scenario is a page of YAML; a larger file is refused unread


@dataclass(frozen=True)
class ScenarioChoice:
    """A loaded scenario and the YAML text it came from (the cache key of its mesh)."""

    scenario: Scenario
    text: str
    source: str


@st.cache_data(show_spinner=False, max_entries=32)
def _parse(text: str, source: str) -> Scenario:
    return parse_scenario_text(text, source)


@st.cache_resource(show_spinner=False, max_entries=16)
def _mesh(text: str, source: str) -> Mesh:
    return _parse(text, source).mesh()


@st.cache_resource(show_spinner=False, max_entries=16)
def _positions(text: str, source: str) -> dict[int, tuple[float, float]]:
    return rank_positions(_mesh(text, source))


def mesh_of(choice: ScenarioChoice) -> Mesh:
    return _mesh(choice.text, choice.source)


def positions_of(choice: ScenarioChoice) -> dict[int, tuple[float, float]]:
    return _positions(choice.text, choice.source)


def mesh_for(text: str, source: str) -> Mesh:
    """The mesh of a scenario by its text and source: for caches keyed by those two strings."""
    return _mesh(text, source)


def positions_for(text: str, source: str) -> dict[int, tuple[float, float]]:
    return _positions(text, source)


def _check_size(size: int, where: str) -> None:
    if size > MAX_SCENARIO_BYTES:
        raise ScenarioError(
            f"{where}: {size:,} bytes is too large for a scenario (at most {MAX_SCENARIO_BYTES:,}); "
            "expected a YAML scenario"
        )


def _scenario_text(content: bytes, where: str) -> str:
    """A scenario file's bytes as text, or one line saying why they are not a YAML scenario."""
    _check_size(len(content), where)
    if not content.strip():
        raise ScenarioError(f"{where}: the file is empty; expected a YAML scenario")
    try:
        return content.decode("utf-8")
    except UnicodeDecodeError:
        raise ScenarioError(f"{where}: not UTF-8 text; expected a YAML scenario") from None


def _read_path(raw: str) -> tuple[str, str]:
    path = Path(raw).expanduser()
    try:
        if path.is_file():
            _check_size(path.stat().st_size, str(path))  # refused unread
        return _scenario_text(path.read_bytes(), str(path)), str(path)
    except FileNotFoundError:
        raise ScenarioError(f"{path}: no such scenario file; give the path of a YAML scenario") from None
    except IsADirectoryError:
        raise ScenarioError(f"{path}: a directory; give the path of a YAML scenario file") from None
    except OSError as exc:
        raise ScenarioError(f"{path}: cannot read a YAML scenario ({exc.strerror or exc})") from None


def _load(source: str) -> ScenarioChoice | None:
    if source == "built-in":
        names = builtin_scenarios()
        if st.session_state.get("scenario_builtin") not in names:
            st.session_state["scenario_builtin"] = "default" if "default" in names else names[0]
        name = st.sidebar.selectbox("scenario", names, key="scenario_builtin")
        path = builtin_scenario_path(name)
        text, where = path.read_text(encoding="utf-8"), f"scenarios/{path.name}"
    elif source == "upload":
        up = st.sidebar.file_uploader("scenario YAML", type=["yaml", "yml"], key="scenario_upload")
        if up is None:
            st.sidebar.info("Upload a scenario YAML; until then the default scenario is shown.")
            return None
        text, where = _scenario_text(up.getvalue(), up.name), up.name
    else:
        raw = st.sidebar.text_input("scenario path", key="scenario_path", placeholder="scenarios/default.yaml")
        if not raw.strip():
            st.sidebar.info("Type the path of a scenario YAML; until then the default scenario is shown.")
            return None
        text, where = _read_path(raw.strip())
    return ScenarioChoice(_parse(text, where), text, where)


def _default() -> ScenarioChoice:
    path = builtin_scenario_path("default")
    text = path.read_text(encoding="utf-8")
    return ScenarioChoice(_parse(text, "scenarios/default.yaml"), text, "scenarios/default.yaml")


def scenario_sidebar() -> None:
    """Draw the scenario picker and store the choice (or its error) for the pages."""
    st.sidebar.subheader("Scenario")
    source = st.sidebar.radio("source", SOURCES, horizontal=True, key="scenario_source", label_visibility="collapsed")
    st.session_state[ERROR_KEY] = None
    try:
        choice = _load(source) or _default()
    except MeshpactError as exc:
        st.session_state[ERROR_KEY] = str(exc)
        st.session_state[SCENARIO_KEY] = None
        return
    st.session_state[SCENARIO_KEY] = choice
    mesh = mesh_of(choice)
    st.sidebar.caption(
        f"**{choice.scenario.name}** · {mesh.world_size} ranks · {len(mesh.domains)} domains · {len(mesh.hosts)} hosts"
    )


def require_scenario() -> ScenarioChoice:
    """Draw the sidebar picker and return its scenario; on a bad scenario file, show its
    readable error and stop the page. Every page calls this first (the picker is drawn
    by the page, not the entry point, so it survives reruns of the page alone).

    The first run of a session opens on the scenario and failed ranks its link names; every
    run writes them back into the link (:func:`keep_in_link`)."""
    first = not st.session_state.get(LINK_READ_KEY)
    if first:
        _read_link_scenario()
    scenario_sidebar()
    error = st.session_state.get(ERROR_KEY)
    choice = st.session_state.get(SCENARIO_KEY)
    if error or choice is None:
        st.error(
            "**This scenario cannot be used.**\n\n"
            + message_markdown(error or "no scenario chosen")
            + "\n\nFix the file, or pick a built-in scenario in the sidebar."
        )
        st.stop()
    if first:
        _read_link_failed(choice)
        st.session_state[LINK_READ_KEY] = True
    _say_carried_failures(choice)
    for problem in st.session_state.get(LINK_PROBLEMS_KEY) or []:
        st.warning(problem)
    st.session_state[LINK_PROBLEMS_KEY] = []  # said once: the page's next run shows the defaults without it
    keep_in_link(choice, st.session_state.get(FAILED_KEY, []))
    return choice


FAILED_ON_KEY = "failed_ranks_scenario"  # the scenario the failed ranks were last shown on


def _say_carried_failures(choice: ScenarioChoice) -> None:
    """Once, on the first run after the scenario changed: which failed ranks came along (and which
    were dropped, outside the new mesh)."""
    name = choice.scenario.name
    before = st.session_state.get(FAILED_ON_KEY)
    st.session_state[FAILED_ON_KEY] = name
    failed = st.session_state.get(FAILED_KEY, [])
    kept = clamp_failed(failed, mesh_of(choice).ranks)
    notice = carried_failures_notice(before, name, kept, set(failed) - set(kept))
    if notice:
        st.info(notice)


def _read_link_scenario() -> None:
    """The link's built-in scenario, set on the picker before it is drawn (or one line why not)."""
    params = st.query_params
    name, problem = scenario_from_link(params.get(LINK_SCENARIO), builtin_scenarios())
    if name is not None:
        st.session_state["scenario_source"] = "built-in"
        st.session_state["scenario_builtin"] = name
    st.session_state[LINK_PROBLEMS_KEY] = [problem] if problem else []


def _read_link_failed(choice: ScenarioChoice) -> None:
    """The link's failed ranks, read against the scenario's mesh (or one line why not)."""
    failed, problem = failed_from_link(st.query_params.get(LINK_FAILED), mesh_of(choice).ranks)
    if failed:
        st.session_state[FAILED_KEY] = failed
    if problem:
        st.session_state.setdefault(LINK_PROBLEMS_KEY, []).append(problem)


def keep_in_link(choice: ScenarioChoice, failed: Iterable[int]) -> None:
    """Write the scenario (a built-in one: a file cannot travel in a link) and the failed ranks
    of this mesh into the page's query parameters, leaving any other parameter alone."""
    builtin = (
        st.session_state.get("scenario_builtin") if st.session_state.get("scenario_source") == "built-in" else None
    )
    want = link_params(builtin, clamp_failed(failed, mesh_of(choice).ranks))
    params = st.query_params
    for key in (LINK_SCENARIO, LINK_FAILED):
        if key not in want and key in params:
            del params[key]
        elif key in want and params.get(key) != want[key]:
            params[key] = want[key]


_MARKDOWN_SPECIAL = "\\`*_{}[]<>()#+-.!|~$"


def message_markdown(message: str) -> str:
    """A multi-line error message as Markdown that shows every character as written:
    the first line as a paragraph, the following lines (``  - field: problem``) as a list."""

    def esc(text: str) -> str:
        return "".join("\\" + ch if ch in _MARKDOWN_SPECIAL else ch for ch in text)

    first, *rest = message.strip().splitlines() or [""]
    items = [line.strip().removeprefix("- ").strip() for line in rest if line.strip()]
    return "\n".join([esc(first), *(["", *(f"- {esc(i)}" for i in items)] if items else [])])
