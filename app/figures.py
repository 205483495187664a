"""Figures: the plotly pictures the dashboard draws.

The mesh (ranks coloured by domain and health, native rings and bridge links as line
traces), the stage breakdown of recoveries, goodput and serving curves of the simulator,
a plan as a diagram of who sends what to whom, and startups and payload bytes per
planner. Each function takes core values and returns a ``plotly.graph_objects.Figure``;
none touches Streamlit, so the benchmark and the tests build them directly. Traces are
few and wide (one per domain, not one per rank) so the 1,024-rank mesh stays fast to
build and to draw.

The Mesh page draws the mesh on a canvas instead (``app/components/``): :func:`mesh_scene`
and :func:`node_scene` give it the same picture as data (cell positions, ids, domain
colours, rings, bridge links, host labels), built once per scenario; the browser paints
health and selection itself, so a click changes pixels at once and sends only rank ids.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence

import hashlib
import html
import json
import math
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from meshpact.app.format import duration
from meshpact.core.facts import Domain, LinkClass, Mesh
from meshpact.core.jsonform import JsonObject
from meshpact.core.mesh import CIRCLE_MAX, bridge_links, health, native_ring, rank_positions
from meshpact.core.plan import Plan, PlanCost, StepKind
from meshpact.core.recovery import Policy, RecoveryBreakdown, Stage

__all__ = [
    "domain_colours",
    "STAGE_COLOURS",
    "mesh_figure",
    "live_mesh_figure",
    "LIVE_LABEL_PX",
    "Node",
    "nodes_of",
    "MeshScene",
    "mesh_scene",
    "node_scene",
    "recovery_figure",
    "recovery_bars_html",
    "plan_figure",
    "cost_figure",
    "goodput_figure",
    "serving_figure",
    "fleet_figure",
]

FAILED = "#d62728"
BROKEN = "#b0b0b0"
_VENDOR_SHADES = {
    "cuda": ["#4c9a2a", "#7bc950", "#2f6b17"],
    "cann": ["#2e6fd8", "#6b9cf0", "#1b4a9c"],
    "cpu": ["#8e6bbf", "#b49ad8", "#5f4391"],
}
_LINK_STYLE = {
    LinkClass.HOST_BRIDGE: ("#e69f00", "dot"),
    LinkClass.ETHERNET: ("#e69f00", "dash"),
    LinkClass.FABRIC: ("#999999", "solid"),
}
STAGE_COLOURS: Mapping[Stage, str] = {
    Stage.DETECTION: "#9e9e9e",
    Stage.RESTART: "#d62728",
    Stage.CONSENSUS: "#9467bd",
    Stage.COMMUNICATOR: "#1f77b4",
    Stage.STATE: "#ff7f0e",
    Stage.REBINDING: "#2ca02c",
    Stage.REPLAY: "#8c564b",
}
POLICY_COLOURS: Mapping[Policy, str] = {
    Policy.COLD_RESTART: "#d62728",
    Policy.CHECKPOINT_RESTORE: "#ff7f0e",
    Policy.IN_MEMORY: "#2ca02c",
    Policy.PEER_RESTORE: "#17becf",
    Policy.EXCISE: "#1f77b4",
}
GL_ABOVE = 4096  # ranks: draw the mesh with WebGL above this
FAILED_MIN_PX = 10  # a failed rank's cross stays this big however small the healthy markers get (3 px at 16,384)
# A white background with light grid lines, as plotly's "plotly_white" draws them, in a template
# small enough to copy: assigning the full built-in template costs tens of milliseconds per figure.
_AXIS = dict(gridcolor="#EBF0F8", linecolor="#EBF0F8", zerolinecolor="#EBF0F8", zerolinewidth=2, ticks="")
_TEMPLATE = go.layout.Template(layout=dict(plot_bgcolor="white", paper_bgcolor="white", xaxis=_AXIS, yaxis=_AXIS))
_LAYOUT = dict(template=_TEMPLATE, margin=dict(l=10, r=10, t=40, b=10))


def domain_colours(mesh: Mesh) -> dict[str, str]:
    """One colour per domain: a vendor's hue, a different shade per domain of that vendor."""
    used: dict[str, int] = {}
    out = {}
    for d in mesh.domains:
        shades = _VENDOR_SHADES.get(d.vendor.value, _VENDOR_SHADES["cpu"])
        out[d.name] = shades[used.get(d.vendor.value, 0) % len(shades)]
        used[d.vendor.value] = used.get(d.vendor.value, 0) + 1
    return out


def _xy(ranks: Sequence[int], pos: Mapping[int, tuple[float, float]]) -> tuple[np.ndarray, np.ndarray]:
    """Coordinates of ``ranks`` as two float32 arrays: numpy arrays pass plotly's validation in
    one step and reach the browser as packed typed arrays (4 bytes a value, far finer than a
    pixel at rank spacings of about 1), which plotly reads without parsing numbers."""
    xy = np.array([pos[r] for r in ranks], dtype=np.float32).reshape(-1, 2)
    return xy[:, 0], xy[:, 1]


def _polyline(pairs: Iterable[tuple[int, int]], pos: Mapping[int, tuple[float, float]]) -> tuple[list, list]:
    xs: list = []
    ys: list = []
    for a, b in pairs:
        xs += [pos[a][0], pos[b][0], None]
        ys += [pos[a][1], pos[b][1], None]
    return xs, ys


def _ring_xy(ring: Sequence[int], pos: Mapping[int, tuple[float, float]]) -> tuple[np.ndarray, np.ndarray]:
    """The ring as a polyline; a circle is closed, a serpentine grid is left open (its
    closing hop would cut across the grid)."""
    closed = list(ring) + ([ring[0]] if 2 < len(ring) <= CIRCLE_MAX else [])
    return _xy(closed, pos)


def _rank_ids(ranks: Sequence[int]) -> np.ndarray:
    """``customdata`` of rank markers: the rank id of each point, one number (not a row: the
    browser reports a packed row as an object, which a selection event cannot carry)."""
    return np.asarray(ranks, dtype=np.int32)


def mesh_figure(
    mesh: Mesh,
    failed: Iterable[int] = (),
    positions: Mapping[int, tuple[float, float]] | None = None,
    height: int | None = None,
    dragmode: str = "select",
    marker_px: int | None = None,
    label_px: int = 8,
    landscape: bool = True,
) -> go.Figure:
    """The mesh: one marker trace per domain (healthy ranks), one for failed ranks, a ring
    per domain (grey and dashed once a member failed) and the bridge links between
    domains. Every rank marker carries its rank id in ``customdata`` for selection.
    ``dragmode`` ``select`` makes a drag draw a box; ``pan`` lets a click pick one rank
    (Streamlit turns click selection off while a drag draws boxes).

    Built for a fast click: coordinates and rank ids are numpy arrays, every marker style is one
    value per trace (a healthy bridge rank is ringed by a small overlay trace instead of a
    per-point outline width, which would make the browser style each point on its own)."""
    pos = positions if positions is not None else rank_positions(mesh)
    state = health(mesh, failed)
    dead = state.failed
    colours = domain_colours(mesh)
    broken = {c.name for c in state.broken}
    labelled = mesh.world_size <= 64
    size = marker_px or (
        14 if mesh.world_size <= 64 else (9 if mesh.world_size <= 256 else (6 if mesh.world_size <= 4096 else 3))
    )
    # Beyond a few thousand points SVG gets slow in the browser; WebGL keeps panning and selection smooth.
    Trace = go.Scattergl if mesh.world_size > GL_ABOVE else go.Scatter
    traces: list[go.BaseTraceType] = []
    for d in mesh.domains:
        xs, ys = _ring_xy(native_ring(d), pos)
        ok = d.name not in broken
        traces.append(
            Trace(
                x=xs,
                y=ys,
                mode="lines",
                hoverinfo="skip",
                showlegend=False,
                line=dict(color=colours[d.name] if ok else BROKEN, width=1.5, dash="solid" if ok else "dash"),
            )
        )
    shown: set[LinkClass] = set()
    for link in bridge_links(mesh):
        colour, dash = _LINK_STYLE[link.link]
        ok = link.communicator not in broken
        bx, by = _polyline([(link.a, link.b)], pos)
        traces.append(
            go.Scatter(
                x=bx,
                y=by,
                mode="lines",
                hoverinfo="skip",
                name=f"bridge ({link.link.value.replace('_', ' ')})",
                legendgroup=link.link.value,
                showlegend=link.link not in shown,
                line=dict(color=colour, dash=dash, width=3) if ok else dict(color=BROKEN, dash=dash, width=3),
            )
        )
        shown.add(link.link)
    for d in mesh.domains:
        alive = [r for r in d.ranks if r not in dead]
        xs, ys = _xy(alive, pos)
        traces.append(
            Trace(
                x=xs,
                y=ys,
                customdata=_rank_ids(alive),
                mode="markers+text" if labelled else "markers",
                text=[str(r) for r in alive] if labelled else None,
                textposition="middle center",
                textfont=dict(size=label_px, color="white"),
                marker=dict(size=size, color=colours[d.name]),
                name=f"{d.name} ({d.backend.value})",  # type: ignore[union-attr]  # Domain.__post_init__ sets it
                hovertemplate=f"rank %{{customdata}}<br>{d.name} · {d.host}<extra></extra>",
            )
        )
    bridges = [d.bridge_rank for d in mesh.domains if d.bridge_rank is not None and d.bridge_rank not in dead]
    if bridges:  # an orange ring around each healthy bridge rank, drawn over its marker; not selectable
        xs, ys = _xy(bridges, pos)
        traces.append(
            go.Scatter(
                x=xs,
                y=ys,
                mode="markers",
                hoverinfo="skip",
                showlegend=False,
                name="bridge rank",
                marker=dict(size=size + 3, color="rgba(0,0,0,0)", line=dict(width=2.5, color="#e69f00")),
            )
        )
    down = sorted(dead)
    xs, ys = _xy(down, pos)
    traces.append(
        go.Scatter(
            x=xs,
            y=ys,
            customdata=_rank_ids(down),
            mode="markers",
            name="failed",
            marker=dict(size=max(size + 2, FAILED_MIN_PX), color=FAILED, symbol="x"),
            hovertemplate="rank %{customdata} (failed)<extra></extra>",
        )
    )
    fig = go.Figure(data=traces)
    xs_all = [p[0] for p in pos.values()]
    ys_all = [p[1] for p in pos.values()]
    span_x = max(xs_all) - min(xs_all) or 1.0
    span_y = max(ys_all) - min(ys_all) or 1.0
    # A mesh that is a line or a point (two ranks) gets a landscape frame, not a tall sliver.
    cx, cy = (max(xs_all) + min(xs_all)) / 2, (max(ys_all) + min(ys_all)) / 2
    pad_y = span_y / 2 + 0.8
    pad_x = max(span_x / 2 + 0.8, 2 * pad_y if landscape else pad_y)
    if height is None:  # about 700 px wide in the page: keep the aspect without empty bands
        height = int(min(820, max(340, 700 * pad_y / pad_x + 130)))
    for h in mesh.hosts:
        ranks = [r for d in mesh.domains if d.host == h for r in d.ranks]
        hx = [pos[r][0] for r in ranks]
        hy = [pos[r][1] for r in ranks]
        fig.add_annotation(x=(min(hx) + max(hx)) / 2, y=max(hy), yshift=22, text=f"<b>{h}</b>", showarrow=False)
    fig.update_layout(
        **_LAYOUT,
        height=height,
        dragmode=dragmode,
        legend=dict(orientation="h", yanchor="top", y=-0.02, x=0),
    )
    fig.update_xaxes(visible=False, range=[cx - pad_x, cx + pad_x])
    fig.update_yaxes(visible=False, scaleanchor="x", scaleratio=1, range=[cy - pad_y, cy + pad_y])
    return fig


LIVE_LABEL_PX = 11  # the smallest rank label the Live mesh draws (px)


def live_mesh_figure(mesh: Mesh, failed: Iterable[int] = ()) -> go.Figure:
    """The Live page's mesh, read at a glance while a run goes: every rank's label in type a
    person reads (:data:`LIVE_LABEL_PX` and up) on a marker it fits in, neighbouring markers
    apart, in a square frame as tall as that needs (a ring of up to 64 ranks), so it never
    shrinks to a sliver in a narrow column."""
    pos = rank_positions(mesh)
    small = mesh.world_size <= 16
    marker, label = (32, 14) if small else (18, LIVE_LABEL_PX)
    ring = native_ring(mesh.domains[0]) if len(mesh.domains) == 1 else list(pos)
    gaps = [math.dist(pos[a], pos[b]) for a, b in zip(ring, ring[1:])] or [1.0]
    ys = [p[1] for p in pos.values()]
    span = 2 * ((max(ys) - min(ys)) / 2 + 0.8)
    px_per_unit = 1.2 * marker / max(min(gaps), 1e-6)  # neighbours apart by a fifth of a marker
    height = int(min(620, max(300, span * px_per_unit + 60)))
    return mesh_figure(mesh, failed, pos, height=height, marker_px=marker, label_px=label, landscape=False)


@dataclass(frozen=True)
class Node:
    """A group of consecutive ranks of one domain drawn as one marker in the aggregated view."""

    index: int
    domain: str
    host: str
    ranks: tuple[int, ...]

    @property
    def label(self) -> str:
        return f"ranks {self.ranks[0]}-{self.ranks[-1]}" if len(self.ranks) > 1 else f"rank {self.ranks[0]}"


def nodes_of(mesh: Mesh, node_ranks: int = 8) -> tuple[Node, ...]:
    """Each domain's ranks in order, cut into nodes of ``node_ranks`` (the last may be short)."""
    out: list[Node] = []
    for d in mesh.domains:
        rs = sorted(d.ranks)
        for i in range(0, len(rs), node_ranks):
            out.append(Node(len(out), d.name, d.host, tuple(rs[i : i + node_ranks])))
    return tuple(out)


@dataclass(frozen=True)
class MeshScene:
    """The mesh as the canvas component draws it: one cell per rank (``kind`` ``ranks``) or
    per node (``nodes``), in drawing units, with the id a pick reports (a rank or a node
    index). Health is not in it: the browser paints the failed set it is given, so one
    scene serves every selection. ``key`` names the scene (a digest of its content), so
    the browser re-reads positions only when it changes."""

    kind: str
    ids: tuple[int, ...]
    xy: tuple[tuple[float, float], ...]
    group: tuple[int, ...]  # index into ``groups`` of each cell
    groups: tuple[JsonObject, ...]  # name, host, label, colour, bridge (cell index or -1)
    rings: tuple[JsonObject, ...]  # group, cells in ring order, closed
    links: tuple[JsonObject, ...]  # a, b (cell indices), colour, dash, label
    hosts: tuple[JsonObject, ...]  # name, x, y (top centre of the host's cells)
    text: tuple[str, ...]  # what a node's hover names it by ("ranks 8-15"); empty for ranks, named by id
    step: float  # the smallest distance between neighbouring cells, for their size on screen
    labelled: bool  # write each cell's id in it (small meshes)
    key: str

    @cached_property
    def payload(self) -> JsonObject:
        """The JSON object the component receives (coordinates to a thousandth of a unit),
        built once per scene: the page sends it on every run (treat it as read-only)."""
        return {
            "kind": self.kind,
            "key": self.key,
            "ids": list(self.ids),
            "x": [round(x, 3) for x, _ in self.xy],
            "y": [round(y, 3) for _, y in self.xy],
            "group": list(self.group),
            "groups": list(self.groups),
            "rings": list(self.rings),
            "links": list(self.links),
            "hosts": list(self.hosts),
            "text": list(self.text),
            "step": self.step,
            "labelled": self.labelled,
        }


def _scene(
    kind: str,
    mesh: Mesh,
    ids: Sequence[int],
    groups_of: Sequence[int],
    pos: Mapping[int, tuple[float, float]],
    rings: Sequence[JsonObject],
    links: Sequence[JsonObject],
    text: Sequence[str],
    labelled: bool,
    neighbours: Sequence[Sequence[int]],
) -> MeshScene:
    colours = domain_colours(mesh)
    cell_of = {r: i for i, r in enumerate(ids)}
    groups = tuple(
        {
            "name": d.name,
            "host": d.host,
            "label": f"{d.name} ({d.backend.value})",  # type: ignore[union-attr]  # Domain.__post_init__ sets it
            "colour": colours[d.name],
            "bridge": cell_of.get(d.bridge_rank, -1) if kind == "ranks" else -1,  # type: ignore[arg-type]  # Domain.__post_init__ sets it
        }
        for d in mesh.domains
    )
    xy = tuple((float(pos[r][0]), float(pos[r][1])) for r in ids)
    hosts = []
    for h in mesh.hosts:
        cells = [i for i, g in enumerate(groups_of) if mesh.domains[g].host == h]
        if cells:
            xs = [xy[i][0] for i in cells]
            hosts.append({"name": h, "x": (min(xs) + max(xs)) / 2, "y": max(xy[i][1] for i in cells)})
    steps = [math.dist(xy[a], xy[b]) for cells in neighbours for a, b in zip(cells, cells[1:])]
    step = min((s for s in steps if s > 0), default=1.0)
    body = (kind, ids, xy, tuple(groups_of), groups, tuple(rings), tuple(links), tuple(hosts), tuple(text))
    key = hashlib.sha1(json.dumps(body, default=str).encode()).hexdigest()[:16]
    return MeshScene(
        kind,
        tuple(ids),
        xy,
        tuple(groups_of),
        groups,
        tuple(rings),
        tuple(links),
        tuple(hosts),
        tuple(text),
        round(step, 4),
        labelled,
        key,
    )


def mesh_scene(mesh: Mesh, positions: Mapping[int, tuple[float, float]] | None = None) -> MeshScene:
    """The rank mesh for the canvas: a cell per rank laid out as :func:`mesh_figure` lays out
    its markers, each domain's ring (closed for a circle, open for a serpentine grid) and a
    bridge link per pair of domains, with its link class."""
    pos = positions if positions is not None else rank_positions(mesh)
    ids = [r for d in mesh.domains for r in d.ranks]
    groups_of = [gi for gi, d in enumerate(mesh.domains) for _ in d.ranks]
    cell_of = {r: i for i, r in enumerate(ids)}
    rings: list[JsonObject] = []
    for gi, d in enumerate(mesh.domains):
        ring = native_ring(d)
        rings.append({"group": gi, "cells": [cell_of[r] for r in ring], "closed": 2 < len(ring) <= CIRCLE_MAX})
    links = []
    for link in bridge_links(mesh):
        colour, dash = _LINK_STYLE[link.link]
        links.append(
            {
                "a": cell_of[link.a],
                "b": cell_of[link.b],
                "colour": colour,
                "dash": dash,
                "label": f"bridge ({link.link.value.replace('_', ' ')})",
            }
        )
    return _scene(
        "ranks", mesh, ids, groups_of, pos, rings, links, (), mesh.world_size <= 64, [ring["cells"] for ring in rings]
    )


def node_scene(mesh: Mesh, nodes: Sequence[Node]) -> MeshScene:
    """The aggregated mesh for the canvas: a cell per node (consecutive ranks of a domain),
    laid out as ranks are (a grid per domain, a column per host); a node's hover text names
    its ranks, domain and host."""
    names = [d.name for d in mesh.domains]
    by_domain: dict[str, list[Node]] = {}
    for n in nodes:
        by_domain.setdefault(n.domain, []).append(n)
    node_mesh = Mesh(
        domains=tuple(
            Domain(d.name, d.vendor, d.host, tuple(n.index for n in by_domain[d.name]), d.backend)
            for d in mesh.domains
            if d.name in by_domain
        )
    )
    pos = rank_positions(node_mesh)
    ids = [n.index for d in mesh.domains for n in by_domain.get(d.name, [])]
    node = {n.index: n for n in nodes}
    groups_of = [names.index(node[i].domain) for i in ids]
    cell_of = {i: c for c, i in enumerate(ids)}
    text = [node[i].label for i in ids]
    return _scene(
        "nodes",
        mesh,
        ids,
        groups_of,
        pos,
        [],
        [],
        text,
        False,
        [[cell_of[i] for i in native_ring(d)] for d in node_mesh.domains],
    )


def recovery_figure(breakdowns: Sequence[RecoveryBreakdown], height: int | None = None) -> go.Figure:
    """Stacked horizontal bars: one bar per policy, one segment per stage (seconds)."""
    fig = go.Figure()
    labels = [b.policy.label for b in breakdowns]
    for stage in Stage.ordered():
        values = [b.durations_s.get(stage, 0.0) for b in breakdowns]
        if not any(values):
            continue
        fig.add_trace(
            go.Bar(
                y=labels,
                x=values,
                orientation="h",
                name=stage.value,
                marker_color=STAGE_COLOURS[stage],
                hovertemplate=f"{stage.value}: %{{x:.3g}} s<extra>%{{y}}</extra>",
            )
        )
    for b in breakdowns:
        fig.add_annotation(
            x=b.total_s, y=b.policy.label, text=f" {duration(b.total_s)}", showarrow=False, xanchor="left"
        )
    # The legend has its own band at the bottom of the figure, under the axis title, never over a
    # bar: room for three rows of stage names, which a column a third of the page wide needs.
    legend_band = 66
    # each bar's total is written past its end: the right margin holds it where the plot is too narrow for
    # the axis' 18 % headroom to (a column a quarter of a 1,024 px page wide cut "11.8 s" at its edge)
    fig.update_layout(
        **{**_LAYOUT, "margin": dict(l=10, r=56, t=20, b=46 + legend_band)},
        barmode="stack",
        height=height or 150 + legend_band + 40 * len(breakdowns),
        xaxis_title="seconds",
        legend=dict(orientation="h", yref="container", yanchor="bottom", y=0, x=0, entrywidth=108, traceorder="normal"),
    )
    fig.update_xaxes(range=[0, max((b.total_s for b in breakdowns), default=1.0) * 1.18 or 1.0])
    fig.update_yaxes(autorange="reversed")
    return fig


def recovery_bars_html(breakdowns: Sequence[RecoveryBreakdown]) -> str:
    """The same stacked bars as :func:`recovery_figure`, as plain HTML: a row per policy, a
    segment per stage as wide as its share of the longest recovery (its seconds in the
    segment's tooltip), the total after the bar, the stages' colours in a legend row above.

    For a page that redraws them on every click: a browser lays out a few dozen boxes at once,
    where a chart library's redraw costs a tenth of a second or more."""
    longest = max((b.total_s for b in breakdowns), default=0.0) or 1.0
    used = [st for st in Stage.ordered() if any(b.durations_s.get(st, 0.0) > 0 for b in breakdowns)]
    chip = (
        '<span style="display:inline-block;margin-right:12px;white-space:nowrap">'
        '<span style="display:inline-block;width:10px;height:10px;background:{c};margin-right:4px"></span>{n}</span>'
    )
    rows = [
        '<div style="font-size:13px;line-height:1.5;margin:0 0 6px 0">'
        + "".join(chip.format(c=STAGE_COLOURS[st], n=html.escape(st.value)) for st in used)
        + "</div>"
    ]
    for b in breakdowns:
        segments = "".join(
            f'<span title="{html.escape(st.value)}: {b.durations_s[st]:.3g} s" style="display:inline-block;height:16px;'
            f'width:{100.0 * b.durations_s[st] / longest:.4f}%;background:{STAGE_COLOURS[st]}"></span>'
            for st in used
            if b.durations_s.get(st, 0.0) > 0
        )
        rows.append(
            '<div style="display:flex;align-items:center;gap:8px;font-size:13px;margin:3px 0">'
            f'<span style="flex:0 0 150px;text-align:right">{html.escape(b.policy.label)}</span>'
            f'<span style="flex:1 1 auto;display:flex;align-items:center"><span style="flex:0 0 82%;display:flex;'
            f'line-height:0">{segments}</span><span style="padding-left:6px;white-space:nowrap">'
            f"{html.escape(duration(b.total_s))}</span></span></div>"
        )
    return '<div class="meshpact-recovery-bars">' + "".join(rows) + "</div>"


def plan_figure(plan: Plan, mesh: Mesh, height: int | None = None) -> go.Figure:
    """Who sends what to whom: steps left to right, the ranks a plan touches top to bottom
    (grouped by domain). A collective is a bar over its participants, a bridge send an
    arrow from sender to receiver, a local projection a diamond, a delivery a star."""
    colours = domain_colours(mesh)
    order = {d.name: i for i, d in enumerate(mesh.domains)}
    involved = sorted({r for s in plan.steps for r in s.ranks}, key=lambda r: (order[mesh.domain_of(r).name], r))
    row = {r: i for i, r in enumerate(involved)}
    fig = go.Figure()
    send_x: list = []
    send_y: list = []
    send_text: list = []
    marks: dict[str, tuple[list, list, list, list]] = {}
    for x, step in enumerate(plan.steps, start=1):
        if step.kind is StepKind.SEND:
            src, dst = step.ranks
            send_x += [x - 0.3, x + 0.3, None]
            send_y += [row[src], row[dst], None]
            send_text += [
                f"send {src}→{dst}: {step.payload_bytes:,} B ({step.link.value if step.link else ''})"
            ] * 2 + [None]
            continue
        if step.kind is StepKind.COLLECTIVE:
            ys = [row[r] for r in step.ranks]
            colour = colours.get(step.domain or mesh.domain_of(step.ranks[0]).name, "#555")
            fig.add_trace(
                go.Scatter(
                    x=[x, x],
                    y=[min(ys), max(ys)],
                    mode="lines",
                    line=dict(color=colour, width=10),
                    opacity=0.35,
                    hoverinfo="skip",
                    showlegend=False,
                )
            )
        symbol = {StepKind.COLLECTIVE: "circle", StepKind.PROJECT: "diamond", StepKind.DELIVER: "star"}[step.kind]
        xs, ys, texts, cols = marks.setdefault(f"{step.kind.value}|{symbol}", ([], [], [], []))
        for r in step.ranks:
            xs.append(x)
            ys.append(row[r])
            texts.append(
                f"step {x}: {step.kind.value} {step.op} on rank {r}<br>{step.payload_bytes:,} B {step.dtype.value}"
                + (f"<br>{step.note}" if step.note else "")
            )
            cols.append(colours[mesh.domain_of(r).name])
    for key, (xs, ys, texts, cols) in marks.items():
        kind, symbol = key.split("|")
        fig.add_trace(
            go.Scatter(
                x=xs,
                y=ys,
                mode="markers",
                name=kind,
                hovertext=texts,
                hoverinfo="text",
                marker=dict(symbol=symbol, size=11, color=cols, line=dict(width=1, color="white")),
            )
        )
    if send_x:
        fig.add_trace(
            go.Scatter(
                x=send_x,
                y=send_y,
                mode="lines+markers",
                name="bridge send",
                hovertext=send_text,
                hoverinfo="text",
                line=dict(color="#e69f00", width=2),
                marker=dict(symbol="arrow", angleref="previous", size=12, opacity=[0, 1, 0] * (len(send_x) // 3)),
            )
        )
    ticks = [f"{r} · {mesh.domain_of(r).name}" for r in involved]
    fig.update_layout(
        **_LAYOUT,
        height=height or max(260, 22 * len(involved) + 120),
        title=f"{plan.planner}: {len(plan.steps)} steps, {plan.startups} startups, {plan.payload_bytes:,} B",
        legend=dict(orientation="h", yanchor="bottom", y=1.02, x=1, xanchor="right"),
    )
    fig.update_xaxes(
        title="step",
        tickmode="array",
        tickvals=list(range(1, len(plan.steps) + 1)),
        ticktext=[s.op for s in plan.steps],
        range=[0.4, len(plan.steps) + 0.6],
    )
    fig.update_yaxes(
        tickmode="array", tickvals=list(range(len(involved))), ticktext=ticks, autorange="reversed", title="rank"
    )
    return fig


def cost_figure(costs: Mapping[str, PlanCost], height: int = 300) -> go.Figure:
    """Startups and payload bytes per planner, side by side; bytes stacked by link class."""
    fig = make_subplots(rows=1, cols=2, subplot_titles=("startups", "payload bytes"))
    names = list(costs)
    fig.add_trace(
        go.Bar(
            x=names,
            y=[costs[n].startups for n in names],
            marker_color="#1f77b4",
            showlegend=False,
            hovertemplate="%{x}: %{y} startups<extra></extra>",
        ),
        row=1,
        col=1,
    )
    links = sorted({k for c in costs.values() for k in c.bytes_by_link})
    palette = {"fabric": "#4c9a2a", "host_bridge": "#e69f00", "ethernet": "#d55e00"}
    for link in links:
        fig.add_trace(
            go.Bar(
                x=names,
                y=[costs[n].bytes_by_link.get(link, 0) for n in names],
                name=link.replace("_", " "),
                marker_color=palette.get(link, "#777"),
                hovertemplate="%{x}: %{y:,} B<extra>" + link + "</extra>",
            ),
            row=1,
            col=2,
        )
    fig.update_layout(**_LAYOUT, barmode="stack", height=height, legend=dict(orientation="h", y=-0.2))
    fig.update_yaxes(type="log", row=1, col=2)
    return fig


_POLICY_DASH = {
    Policy.COLD_RESTART: "solid",
    Policy.CHECKPOINT_RESTORE: "dash",
    Policy.IN_MEMORY: "solid",
    Policy.PEER_RESTORE: "dashdot",
    Policy.EXCISE: "dot",
}  # lines that coincide stay distinguishable


_LEGEND_ROW_PX = 21  # one row of a horizontal legend


def _legend_band(rows: int, top: int = 40) -> dict[str, Any]:
    """Layout that gives a horizontal legend its own band at the bottom of the figure, under the x-axis
    title, with room for ``rows`` rows (as many as the narrowest column the figure is drawn in wraps it
    to): anchored to the figure's edge in pixels, not to the plot, so it never prints over the axis."""
    band = rows * _LEGEND_ROW_PX
    return dict(
        margin=dict(l=10, r=10, t=top, b=50 + band),
        legend=dict(orientation="h", yref="container", yanchor="bottom", y=0, x=0, traceorder="normal"),
    )


def goodput_figure(
    frame: Any,
    knob: str,
    title: str,
    x_title: str | None = None,
    log_x: bool = True,
    height: int = 400,
    current: float | None = None,
) -> go.Figure:
    """Goodput of each policy (one line each) against one knob of a training sweep; a
    vertical line marks ``current``, the knob's value in the page's setting."""
    fig = go.Figure()
    for policy in Policy:
        rows = frame[frame["policy"] == policy.value]
        if rows.empty:
            continue
        fig.add_trace(
            go.Scatter(
                x=rows[knob],
                y=rows["goodput"],
                mode="lines+markers",
                name=policy.label,
                line=dict(color=POLICY_COLOURS[policy], width=2.5, dash=_POLICY_DASH[policy]),
                customdata=rows[["downtime_s", "lost_steps"]].to_numpy(),
                hovertemplate="%{x}: goodput %{y:.2%}<br>downtime %{customdata[0]:,.0f} s, lost steps %{customdata[1]}"
                f"<extra>{policy.label}</extra>",
            )
        )
    # five policy names wrap to four rows in a column half as wide as a 1,024 px page
    top = 40 if current is None or current <= 0 or min(frame[knob]) <= current <= max(frame[knob]) else 60
    fig.update_layout(
        **{**_LAYOUT, **_legend_band(4, top)},
        height=height,
        title=title,
        yaxis_tickformat=".2~%",
        yaxis_title="goodput",
    )
    values = sorted(set(frame[knob]))
    fig.update_xaxes(
        type="log" if log_x else "linear",
        title=x_title or knob.replace("_", " "),
        tickmode="array",
        tickvals=values,
        ticktext=[f"{v:,g}" for v in values],
    )
    if current is not None and current > 0:
        if min(values) <= current <= max(values):
            fig.add_vline(x=current, line=dict(color="#444", width=1.5, dash="dot"))
            fig.add_annotation(
                x=math.log10(current) if log_x else current,
                y=1.0,
                yref="paper",
                yanchor="bottom",
                text=f"this setting: {current:,g}",
                showarrow=False,
                font=dict(size=11),
            )
        else:
            fig.update_layout(
                title=dict(text=title, subtitle=dict(text=f"this setting, {current:,g}, is outside the sweep"))
            )
    return fig


def serving_figure(frame: Any, height: int = 380) -> go.Figure:
    """Throughput and result traffic over the link against concurrency, one line per request."""
    fig = make_subplots(rows=1, cols=2, subplot_titles=("throughput (tokens/s)", "result bytes over the link"))
    palette = {"full": "#d55e00", "logprob": "#e69f00", "token": "#2ca02c", "owner_token": "#1f77b4"}
    # Lines that coincide (equal throughput until the link saturates) stay visible: the
    # first drawn is widest and solid, later ones thinner, dashed and with other markers.
    styles = [("solid", "circle", 5.0), ("dash", "diamond", 3.0), ("dot", "square", 2.5), ("dashdot", "x", 2.0)]
    for i, (req, rows) in enumerate(frame.groupby("request", sort=False)):
        colour = palette.get(str(req), "#777")
        dash, symbol, width = styles[i % len(styles)]
        fig.add_trace(
            go.Scatter(
                x=rows["concurrency"],
                y=rows["throughput_tok_s"],
                mode="lines+markers",
                name=str(req),
                line=dict(color=colour, width=width, dash=dash),
                marker=dict(symbol=symbol, size=7 + width),
                legendgroup=str(req),
                hovertemplate="concurrency %{x}: %{y:,.0f} tok/s<extra>" + str(req) + "</extra>",
            ),
            row=1,
            col=1,
        )
        fig.add_trace(
            go.Scatter(
                x=rows["concurrency"],
                y=rows["result_bytes"],
                mode="lines+markers",
                name=str(req),
                line=dict(color=colour, width=width, dash=dash),
                marker=dict(symbol=symbol, size=7 + width),
                legendgroup=str(req),
                showlegend=False,
                hovertemplate="concurrency %{x}: %{y:,.0f} B<extra>" + str(req) + "</extra>",
            ),
            row=1,
            col=2,
        )
    fig.update_layout(**{**_LAYOUT, **_legend_band(2)}, height=height)
    values = sorted(set(frame["concurrency"]))
    fig.update_xaxes(
        type="log",
        title="concurrency (requests in flight)",
        tickmode="array",
        tickvals=values,
        ticktext=[str(v) for v in values],
    )
    fig.update_yaxes(title="tokens/s", tickformat=",.0f", row=1, col=1)
    fig.update_yaxes(type="log", title="bytes", exponentformat="SI", ticksuffix="B", row=1, col=2)  # 1GB, not "1B"
    return fig


def fleet_figure(frame: Any, height: int = 330) -> go.Figure:
    """Time to finish and effective training ratio of each policy on a fleet, with their
    intervals as error bars (``frame``: policy, finish_h, finish_h_half_width,
    effective_training_ratio, effective_training_ratio_half_width)."""
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=1, cols=2, subplot_titles=("time to finish (h)", "effective training ratio"))
    for policy in Policy:
        rows = frame[frame["policy"] == policy.value]
        if rows.empty:
            continue
        for col, key in ((1, "finish_h"), (2, "effective_training_ratio")):
            fig.add_trace(
                go.Bar(
                    x=[policy.label],
                    y=rows[key],
                    name=policy.label,
                    showlegend=False,
                    marker_color=POLICY_COLOURS[policy],
                    error_y=dict(type="data", array=rows[f"{key}_half_width"], visible=True, color="#444"),
                    hovertemplate=f"{policy.label}: %{{y:,.4g}} ± %{{error_y.array:,.3g}}<extra></extra>",
                ),
                row=1,
                col=col,
            )
    fig.update_layout(**_LAYOUT, height=height)
    fig.update_yaxes(tickformat=".0%", row=1, col=2, range=[0, 1])
    return fig
