"""The mesh figures as the browser receives them: what each marker says, and a payload
cheap to draw.

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

from meshpact.app.figures import mesh_figure, node_figure, nodes_of
from meshpact.app.state import ranks_in_event
from meshpact.core.facts import Domain, Mesh

# Three domains of uneven sizes on two hosts; two bridge ranks set away from the ends of their domains.
MESH = Mesh(domains=(Domain("cuda@hostA", "cuda", "hostA", tuple(range(0, 300)), bridge_rank=7),
                     Domain("cann@hostB", "cann", "hostB", tuple(range(300, 701)), bridge_rank=650),
                     Domain("cpu@hostB", "cpu", "hostB", tuple(range(701, 714)))))

_DTYPES = {"i1": np.int8, "i2": np.int16, "i4": np.int32, "u1": np.uint8, "u2": np.uint16, "u4": np.uint32,
           "f4": np.float32, "f8": np.float64, "i8": np.int64}


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


def test_the_node_view_picks_nodes_by_index_and_names_their_ranks():
    nodes = nodes_of(MESH, 8)
    spec = _sent(node_figure(MESH, nodes, failed=[9, 713]))
    ids = sorted(i for t in spec["data"] for i in _values(t.get("customdata")))
    assert ids == [n.index for n in nodes]
    hit = next(t for t in spec["data"] if t["name"] == "node with failed ranks")
    picked = {nodes[i] for i in _values(hit["customdata"])}
    assert {r for n in picked for r in n.ranks} >= {9, 713} and len(picked) == 2
    first = next(t for t in spec["data"] if t["name"] == "cuda@hostA")
    assert first["text"][0] == "ranks 0-7"
    assert next(t for t in spec["data"] if t["name"] == "cpu@hostB")["text"] == ["ranks 701-708"]  # 709-713 failed


def test_a_failed_rank_stays_visible_among_16384_ranks():
    big = Mesh(domains=(Domain("cuda@podA", "cuda", "podA", tuple(range(8192))),
                        Domain("cann@podB", "cann", "podB", tuple(range(8192, 16384)))))
    spec = _sent(mesh_figure(big, failed=[9999]))
    healthy = max(t["marker"]["size"] for t in _markers(spec) if t.get("name") != "failed")
    failed = next(t for t in spec["data"] if t.get("name") == "failed")
    assert _values(failed["customdata"]) == [9999]
    assert healthy <= 4 and failed["marker"]["size"] >= 10  # a cross wider than two grid cells, not a red speck
