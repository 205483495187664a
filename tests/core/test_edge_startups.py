"""Startups of the lowerer's startups-first plan against the layout-only baseline on the nine real
edges, and the bound that makes the one tie optimal (docs/edges.md, rendered by
scripts/render_edges.py)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from meshpact.core.contract import compile_contract
from meshpact.core.edges import EDGES

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def edges_page():
    spec = importlib.util.spec_from_file_location("render_edges", ROOT / "scripts" / "render_edges.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[spec.name]


# (layout-only, startups-first) per edge: the lowerer needs fewer on eight, ties on the distill edge
PINNED = {
    "qwen3-14b-lm-head-logprob": (21, 3),
    "qwen3-14b-lm-head-token": (4, 2),
    "minimax-m2-lm-head-owner-token": (9, 5),
    "qwen3-14b-mlp-down-reduced": (5, 3),
    "llama-3.1-8b-column-activation-shard": (5, 3),
    "qwen3-30b-a3b-moe-combine": (9, 3),
    "llama-3.1-8b-kv-prefill-to-decode": (9, 8),
    "qwen3-14b-full-logits-distill": (5, 5),
    "mistral-7b-pipeline-hidden-handoff": (5, 2),
}


def test_the_startups_first_plan_against_the_baseline_on_every_edge(edges_page):
    rows = edges_page.edge_startups()
    assert {r.edge: (r.layout_only, r.startups_first) for r in rows} == PINNED
    assert [r.edge for r in rows if r.outcome != "fewer"] == [edges_page.TIED_EDGE]


def test_no_plan_of_the_tied_edge_below_the_bound_passes_the_checker(edges_page):
    contract = compile_contract(EDGES[edges_page.TIED_EDGE].edge)
    bound = edges_page.Bound.of(contract)
    assert bound.startups == PINNED[edges_page.TIED_EDGE][0]  # the baseline's count is the floor
    cands = edges_page.candidates(contract)
    below = [c for c in cands if c.startups < bound.startups]
    assert len(below) >= 6 and not [c.label for c in below if c.ok]
    # each is refused for the rule the bound rests on
    kinds = {k for c in below for k in c.violations}
    assert {"cross_domain_collective", "malformed_step", "demand_not_met"} <= kinds
    assert all(c.ok for c in cands if c.label.startswith(("layout-only", "lowerer")))
    assert min(c.startups for c in cands if c.ok) == bound.startups


def test_the_bound_covers_only_what_its_argument_holds_for(edges_page):
    with pytest.raises(ValueError, match="full, bitwise, cross-domain"):
        edges_page.Bound.of(compile_contract(EDGES["qwen3-14b-lm-head-token"].edge))


def test_the_edges_page_is_what_the_script_renders(edges_page):
    assert (ROOT / "docs" / "edges.md").read_text() == edges_page.render()
