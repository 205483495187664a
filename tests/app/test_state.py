"""Selection to state: chart clicks and the multiselect into failed ranks."""

from __future__ import annotations

from meshpact.app.state import SelectionState, apply_selection, clamp_failed, ranks_in_event


def _event(*ranks, scalar=False, curve=3):
    return {"selection": {"points": [{"curve_number": curve, "point_index": r, "customdata": r if scalar else [r]}
                                     for r in ranks],
                          "point_indices": [], "box": [], "lasso": []}}


def test_ranks_in_event_reads_customdata_list_or_scalar_and_ignores_lines():
    ev = _event(3, 5)
    ev["selection"]["points"].append({"curve_number": 0, "x": 1.0})  # a ring point: no rank
    assert ranks_in_event(ev) == {3, 5}
    assert ranks_in_event(_event(7, scalar=True)) == {7}
    assert ranks_in_event(None) == frozenset()
    assert ranks_in_event({"selection": None}) == frozenset()


def test_single_click_toggles_a_rank_once_per_event():
    s = apply_selection(SelectionState(), [], _event(3))
    assert s.sorted_failed == [3]
    # the same event is still in session state on the next rerun: nothing changes
    s2 = apply_selection(s, s.sorted_failed, _event(3))
    assert s2.sorted_failed == [3]
    # clicking elsewhere empties the selection; clicking 3 again toggles it back
    s3 = apply_selection(s2, s2.sorted_failed, _event())
    s4 = apply_selection(s3, s3.sorted_failed, _event(3))
    assert s4.sorted_failed == []


def test_click_on_another_rank_adds_it():
    s = apply_selection(SelectionState(), [], _event(3))
    s = apply_selection(s, s.sorted_failed, _event(20))
    assert s.sorted_failed == [3, 20]


def test_box_selection_fails_all_selected_ranks():
    s = apply_selection(SelectionState(frozenset({1})), [1], _event(1, 2, 3))
    assert s.sorted_failed == [1, 2, 3]


def test_multiselect_edits_are_kept_when_no_new_event():
    s = apply_selection(SelectionState(), [], _event(3))
    s = apply_selection(s, [3, 9], _event(3))
    assert s.sorted_failed == [3, 9]
    s = apply_selection(s, [], _event(3))
    assert s.sorted_failed == []


def test_clamp_failed_drops_ranks_missing_from_a_smaller_mesh():
    assert clamp_failed([1, 40, 7], range(32)) == [1, 7]


def test_clicking_a_failed_rank_again_heals_it():
    # once failed, rank 3 is drawn in the 'failed' trace: the same rank, another curve
    s = apply_selection(SelectionState(), [], _event(3, curve=3))
    s = apply_selection(s, s.sorted_failed, _event(3, curve=5))
    assert s.sorted_failed == []


def test_error_messages_keep_every_character_in_markdown():
    from meshpact.app.context import message_markdown

    md = message_markdown("a_b.yaml: bad:\n  - cluster.domains.0.vendor: expected one of [cuda] (got 'tpu')\n")
    first, blank, item = md.splitlines()
    assert first == r"a\_b\.yaml: bad:" and blank == ""
    assert item == r"- cluster\.domains\.0\.vendor: expected one of \[cuda\] \(got 'tpu'\)"
