"""Dashboard context: the scenario picker and the cached values every page shares.

The sidebar (drawn by :func:`require_scenario`, which every page calls first) offers
the built-in scenarios, an uploaded YAML file or a path on disk. The
chosen scenario is parsed once per distinct text (``st.cache_data``); its mesh and
drawing positions are shared handles (``st.cache_resource``). A file that does not
parse or does not match the schema shows its :class:`ScenarioError` message on the page
instead of a traceback, and the page stops there.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import streamlit as st

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
]

SCENARIO_KEY = "meshpact_scenario"
ERROR_KEY = "meshpact_scenario_error"
SOURCES = ("built-in", "upload", "path")


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


def _read_path(raw: str) -> tuple[str, str]:
    path = Path(raw).expanduser()
    try:
        return path.read_text(encoding="utf-8"), str(path)
    except FileNotFoundError:
        raise ScenarioError(f"{path}: no such scenario file; give the path of a YAML scenario") from None
    except (IsADirectoryError, UnicodeDecodeError, PermissionError) as exc:
        raise ScenarioError(f"{path}: cannot read a YAML scenario ({exc})") from None


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
        text, where = up.getvalue().decode("utf-8", errors="replace"), up.name
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
    st.sidebar.caption(f"**{choice.scenario.name}** · {mesh.world_size} ranks · {len(mesh.domains)} domains · "
                       f"{len(mesh.hosts)} hosts")


def require_scenario() -> ScenarioChoice:
    """Draw the sidebar picker and return its scenario; on a bad scenario file, show its
    readable error and stop the page. Every page calls this first (the picker is drawn
    by the page, not the entry point, so it survives reruns of the page alone)."""
    scenario_sidebar()
    error = st.session_state.get(ERROR_KEY)
    choice = st.session_state.get(SCENARIO_KEY)
    if error or choice is None:
        st.error("**This scenario cannot be used.**\n\n" + message_markdown(error or "no scenario chosen")
                 + "\n\nFix the file, or pick a built-in scenario in the sidebar.")
        st.stop()
    return choice


_MARKDOWN_SPECIAL = "\\`*_{}[]<>()#+-.!|~$"


def message_markdown(message: str) -> str:
    """A multi-line error message as Markdown that shows every character as written:
    the first line as a paragraph, the following lines (``  - field: problem``) as a list."""
    def esc(text: str) -> str:
        return "".join("\\" + ch if ch in _MARKDOWN_SPECIAL else ch for ch in text)

    first, *rest = message.strip().splitlines() or [""]
    items = [line.strip().removeprefix("- ").strip() for line in rest if line.strip()]
    return "\n".join([esc(first), *(["", *(f"- {esc(i)}" for i in items)] if items else [])])
