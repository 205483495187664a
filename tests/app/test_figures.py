"""The mesh figures as the browser receives them: what each marker says, and a payload
cheap to draw; the canvas scene of the Mesh page and how its picks are applied.

The figure goes through ``plotly.io.to_json`` as ``st.plotly_chart`` sends it, and is
read back as plotly.js would see it: every rank drawn once with its own id, a click on
any marker selecting that rank, bridge ranks ringed only while healthy, and no per-point
style arrays (they make the browser style every point on its own on each click).
"""

from __future__ import annotations

import base64
import json

import numpy as np
import plotly.io

from meshpact.app.components import apply_pick, read_pick
from meshpact.app.figures import mesh_figure, mesh_scene, node_scene, nodes_of
from meshpact.app.state import ranks_in_event
from meshpact.core.facts import Domain, Mesh, Vendor

# Three domains of uneven sizes on two hosts; two bridge ranks set away from the ends of their domains.
MESH = Mesh(
    domains=(
        Domain("cuda@hostA", Vendor.CUDA, "hostA", tuple(range(0, 300)), bridge_rank=7),
        Domain("cann@hostB", Vendor.CANN, "hostB", tuple(range(300, 701)), bridge_rank=650),
        Domain("cpu@hostB", Vendor.CPU, "hostB", tuple(range(701, 714))),
    )
)

_DTYPES = {
    "i1": np.int8,
    "i2": np.int16,
    "i4": np.int32,
    "u1": np.uint8,
    "u2": np.uint16,
    "u4": np.uint32,
    "f4": np.float32,
    "f8": np.float64,
    "i8": np.int64,
}


def _values(v):  # noqa: ANN001, ANN202 (JSON)
    """A JSON array or a plotly typed array (``{"dtype", "bdata"}``) as a Python list."""
    if isinstance(v, dict) and "bdata" in v:
        return np.frombuffer(base64.b64decode(v["bdata"]), dtype=_DTYPES[v["dtype"]]).tolist()
    return list(v) if v is not None else []


def _sent(fig) -> dict:  # noqa: ANN001
    return json.loads(plotly.io.to_json(fig, validate=False))


def _markers(spec: dict) -> list[dict]:
    return [t for t in spec["data"] if "markers" in t.get("mode", "") and "customdata" in t]


def test_every_rank_is_drawn_once_with_its_own_id_and_a_click_reads_it_back():
    spec = _sent(mesh_figure(MESH, failed=[3, 650, 713]))
    ids = [r for t in _markers(spec) for r in _values(t["customdata"])]
    assert sorted(ids) == list(range(714))
    failed = next(t for t in spec["data"] if t.get("name") == "failed")
    assert sorted(_values(failed["customdata"])) == [3, 650, 713]
    for t in _markers(spec):  # the event Streamlit sends for a click on the marker i of trace t
        xs, cd = _values(t["x"]), _values(t["customdata"])
        assert len(xs) == len(cd)
        i = len(cd) // 2
        event = {"selection": {"points": [{"curve_number": 0, "point_index": i, "customdata": cd[i]}]}}
        assert ranks_in_event(event) == {cd[i]}


def test_healthy_bridge_ranks_are_ringed_and_a_failed_one_is_not():
    def ringed(failed: list[int]) -> set[tuple[float, float]]:
        spec = _sent(mesh_figure(MESH, failed=failed))
        ring = [t for t in spec["data"] if t.get("name") == "bridge rank"]
        return {(round(x, 3), round(y, 3)) for t in ring for x, y in zip(_values(t["x"]), _values(t["y"]))}

    def at(rank: int, failed: list[int]) -> tuple[float, float]:
        spec = _sent(mesh_figure(MESH, failed=failed))
        for t in _markers(spec):
            cd = _values(t["customdata"])
            if rank in cd:
                i = cd.index(rank)
                return round(_values(t["x"])[i], 3), round(_values(t["y"])[i], 3)
        raise AssertionError(rank)

    bridges = [d.bridge_rank for d in MESH.domains]
    assert bridges == [7, 650, 701]  # the cpu domain's bridge defaults to its first rank
    assert ringed([]) == {at(r, []) for r in bridges}
    assert ringed([650, 3]) == {at(7, [650, 3]), at(701, [650, 3])}


def test_no_marker_style_is_set_point_by_point():
    for failed in ([], [0, 1, 2, 699]):
        for t in _sent(mesh_figure(MESH, failed=failed))["data"]:
            marker = t.get("marker", {})
            for key in ("size", "color", "symbol", "opacity"):
                assert not isinstance(marker.get(key), (list, dict)), (t.get("name"), key)
            assert not isinstance(marker.get("line", {}).get("width"), (list, dict)), t.get("name")


def test_a_failed_rank_stays_visible_among_16384_ranks():
    big = Mesh(
        domains=(
            Domain("cuda@podA", Vendor.CUDA, "podA", tuple(range(8192))),
            Domain("cann@podB", Vendor.CANN, "podB", tuple(range(8192, 16384))),
        )
    )
    spec = _sent(mesh_figure(big, failed=[9999]))
    healthy = max(t["marker"]["size"] for t in _markers(spec) if t.get("name") != "failed")
    failed = next(t for t in spec["data"] if t.get("name") == "failed")
    assert _values(failed["customdata"]) == [9999]
    assert healthy <= 4 and failed["marker"]["size"] >= 10  # a cross wider than two grid cells, not a red speck


# --- the canvas scene: the same picture as data, which the browser paints and picks from ---


def test_the_scene_draws_every_rank_once_where_the_figure_draws_it():
    from meshpact.core.mesh import native_ring, rank_positions

    scene = mesh_scene(MESH)
    sent = json.loads(json.dumps(scene.payload))  # what the component receives
    assert sorted(sent["ids"]) == list(range(714))
    pos = rank_positions(MESH)
    for r, x, y in zip(sent["ids"], sent["x"], sent["y"]):
        assert abs(x - pos[r][0]) <= 5e-4 and abs(y - pos[r][1]) <= 5e-4, r
    domain_of = {r: gi for gi, d in enumerate(MESH.domains) for r in d.ranks}
    assert [domain_of[r] for r in sent["ids"]] == sent["group"]
    bridges = [sent["ids"][g["bridge"]] for g in sent["groups"]]
    assert bridges == [7, 650, 701]
    for gi, (ring, d) in enumerate(zip(sent["rings"], MESH.domains)):  # each ring in the domain's ring order
        assert ring["group"] == gi and [sent["ids"][c] for c in ring["cells"]] == list(native_ring(d))
        assert ring["closed"] is (d.size <= 64)  # a circle closes, a serpentine grid does not
    linked = {frozenset((sent["ids"][link["a"]], sent["ids"][link["b"]])) for link in sent["links"]}
    assert linked == {frozenset(p) for p in ((7, 650), (7, 701), (650, 701))}
    assert {h["name"] for h in sent["hosts"]} == {"hostA", "hostB"}
    top_a = max(pos[r][1] for r in MESH.domains[0].ranks)
    assert next(h for h in sent["hosts"] if h["name"] == "hostA")["y"] == top_a
    assert sent["labelled"] is False and 0.29 <= sent["step"] <= 0.31  # the grid's spacing (SPACING)


def test_the_scene_key_names_its_content():
    assert mesh_scene(MESH).key == mesh_scene(MESH).key
    moved = Mesh(domains=(MESH.domains[1], MESH.domains[0], MESH.domains[2]))
    fewer = Mesh(domains=MESH.domains[:2])
    keys = {mesh_scene(m).key for m in (MESH, moved, fewer)}
    assert len(keys) == 3
    small = Mesh(domains=(Domain("a", Vendor.CUDA, "h", (0, 1)),))
    assert mesh_scene(small).labelled and mesh_scene(small).kind == "ranks"


def test_the_node_scene_names_each_node_by_its_ranks():
    nodes = nodes_of(MESH, 8)
    scene = node_scene(MESH, nodes)
    sent = json.loads(json.dumps(scene.payload))
    assert sent["kind"] == "nodes" and sorted(sent["ids"]) == [n.index for n in nodes]
    for i, text in zip(sent["ids"], sent["text"]):
        assert text == nodes[i].label
    assert sent["text"][sent["ids"].index(nodes[-1].index)] == "ranks 709-713"  # the short last node of cpu@hostB
    assert sent["rings"] == [] and sent["links"] == [] and sent["step"] > 0
    assert scene.key != mesh_scene(MESH).key


def test_a_canvas_pick_is_applied_once_and_only_on_its_scene():
    value = {"scene": "s1", "instance": "frameA", "seq": 3, "ids": [5, 9]}
    pick = read_pick(value)
    assert pick is not None and pick.ids == {5, 9}
    assert apply_pick(None, pick, "s1") == {5, 9}
    assert apply_pick(pick.ack, pick, "s1") is None  # the same value on the next rerun: already applied
    assert apply_pick(None, pick, "s2") is None  # made on a scene no longer shown
    # another frame (a page switch makes a new one) counts its own picks: the same number from it is new
    fresh = read_pick({"scene": "s1", "instance": "frameB", "seq": 3, "ids": []})
    assert apply_pick(pick.ack, fresh, "s1") == frozenset()
    for bad in (
        None,
        [],
        "5",
        {"scene": "s1"},
        {"scene": "s1", "instance": "a", "seq": "x", "ids": []},
        {"scene": "s1", "instance": "a", "seq": 1, "ids": 5},
        {"scene": "s1", "instance": "a", "seq": 1, "ids": ["five"]},
    ):
        assert read_pick(bad) is None, bad


def test_recovery_bars_html_are_proportional_with_tooltips_totals_and_only_the_stages_used():
    import re

    from meshpact.app.figures import recovery_bars_html
    from meshpact.core.recovery import Policy, RecoveryBreakdown, Stage

    slow = RecoveryBreakdown(Policy.COLD_RESTART, {Stage.DETECTION: 2.0, Stage.RESTART: 6.0, Stage.REPLAY: 2.0})
    fast = RecoveryBreakdown(Policy.IN_MEMORY, {Stage.DETECTION: 2.0, Stage.CONSENSUS: 0.5, Stage.RESTART: 0.0})
    out = recovery_bars_html([slow, fast])
    widths = [(t, float(w)) for t, w in re.findall(r'title="([^"]+)" style="[^"]*width:([0-9.]+)%', out)]
    assert widths == [
        ("detection: 2 s", 20.0),
        ("restart: 6 s", 60.0),
        ("replay: 2 s", 20.0),
        ("detection: 2 s", 20.0),
        ("consensus: 0.5 s", 5.0),
    ]  # shares of the longest, 10 s
    legend = out.split("</div>", 1)[0]
    assert [n for n in ("detection", "restart", "consensus", "replay", "state", "rebinding") if n in legend] == [
        "detection",
        "restart",
        "consensus",
        "replay",
    ]  # a stage no policy spends time in is not listed
    assert out.index(Policy.COLD_RESTART.label) < out.index(Policy.IN_MEMORY.label)
    assert "10 s" in out and "2.5 s" in out  # each total after its bar
    assert recovery_bars_html([]).count("<span title") == 0
