"""Selection to state: chart clicks and the multiselect into failed ranks."""

from __future__ import annotations

from meshpact.app.state import SelectionState, apply_selection, clamp_failed, ranks_in_event


def _event(*ranks, scalar=False, curve=3):
    return {
        "selection": {
            "points": [{"curve_number": curve, "point_index": r, "customdata": r if scalar else [r]} for r in ranks],
            "point_indices": [],
            "box": [],
            "lasso": [],
        }
    }


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


def test_parse_ranks_reads_exact_ranks_and_ranges():
    from meshpact.app.state import parse_ranks

    ranks = range(32)
    assert parse_ranks("5", ranks) == {5}  # not 5, 15 and 25
    assert parse_ranks("5-9, 12", ranks) == {5, 6, 7, 8, 9, 12}
    assert parse_ranks(" 31 ,0,", ranks) == {0, 31}
    assert parse_ranks("2..4; 7\u20139", ranks) == {2, 3, 4, 7, 8, 9}
    assert parse_ranks("", ranks) == frozenset()
    # a mesh with a gap: a range takes the ranks that exist; a single missing rank is an error
    assert parse_ranks("2-12", [0, 1, 2, 10, 11, 20]) == {2, 10, 11}


def test_parse_ranks_refuses_bad_text_with_one_line_and_no_unbounded_work():
    import time

    import pytest

    from meshpact.app.state import parse_ranks

    for text, says in [
        ("x", "'x' is not a rank or a range"),
        ("9-5", "runs backwards"),
        ("32", "rank 32 is not"),
        ("-3", "is not a rank or a range"),
        ("1-2-3", "is not a rank or a range"),
        ("3-", "is not a rank or a range"),
        ("1.5", "is not a rank or a range"),
    ]:
        with pytest.raises(ValueError, match=says) as info:
            parse_ranks(text, range(32))
        assert "\n" not in str(info.value)
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match="not in this mesh"):
        parse_ranks("0-99999999999999", range(16384))
    assert time.perf_counter() - t0 < 1.0


def test_format_ranks_round_trips_through_parse_ranks():
    import random

    from meshpact.app.state import format_ranks, parse_ranks

    assert format_ranks([1, 2, 3, 7, 8, 10]) == "1-3, 7, 8, 10"
    assert format_ranks([]) == ""
    rng = random.Random(7)
    for _ in range(50):
        picked = {rng.randrange(2048) for _ in range(rng.randrange(1, 300))}
        assert parse_ranks(format_ranks(picked), range(2048)) == picked


def test_carry_widget_state_puts_back_what_a_page_switch_dropped():
    from meshpact.app.state import KEPT_STORE, carry_widget_state

    session: dict = {"scenario_builtin": "whatif_1024", "other": 1}
    carry_widget_state(session, ["scenario_builtin", "replay_source"])
    assert session[KEPT_STORE] == {"scenario_builtin": "whatif_1024"}
    del session["scenario_builtin"]  # a page without the picker ran: Streamlit dropped the widget's value
    carry_widget_state(session, ["scenario_builtin", "replay_source"])
    assert session["scenario_builtin"] == "whatif_1024"
    assert "replay_source" not in session  # never set: nothing invented
    session["scenario_builtin"] = "default"  # the user picked again: the new value is kept
    carry_widget_state(session, ["scenario_builtin"])
    del session["scenario_builtin"]
    carry_widget_state(session, ["scenario_builtin"])
    assert session["scenario_builtin"] == "default"


def test_a_link_names_a_builtin_scenario_or_says_in_one_line_why_the_default_is_shown():
    from meshpact.app.state import scenario_from_link

    names = ["default", "whatif_1024"]
    assert scenario_from_link("whatif_1024", names) == ("whatif_1024", None)
    assert scenario_from_link(None, names) == (None, None) and scenario_from_link(" ", names) == (None, None)
    for bad in ("nosuch", "../etc/passwd", "x" * 5000):
        name, problem = scenario_from_link(bad, names)
        assert name is None and "\n" not in problem and "default scenario is shown" in problem
        assert len(problem) < 200  # a long value is shortened, not echoed whole


def test_a_links_failed_ranks_are_read_exactly_or_none_with_one_line():
    from meshpact.app.state import failed_from_link

    assert failed_from_link("5, 600-603", range(1024)) == ([5, 600, 601, 602, 603], None)
    assert failed_from_link(None, range(8)) == ([], None)
    for bad in ("5,x-", "9-2", "2000", "1-99999999999"):
        ranks, problem = failed_from_link(bad, range(1024))
        assert ranks == [] and "\n" not in problem and problem.startswith("The link's failed ranks are not used")


def test_link_params_round_trip_through_the_readers():
    from meshpact.app.state import failed_from_link, link_params, scenario_from_link

    params = link_params("whatif_1024", [603, 5, 600, 601, 602])
    assert params == {"scenario": "whatif_1024", "failed": "5, 600-603"}
    assert scenario_from_link(params["scenario"], ["whatif_1024"])[0] == "whatif_1024"
    assert failed_from_link(params["failed"], range(1024))[0] == [5, 600, 601, 602, 603]
    assert link_params(None, []) == {}  # an uploaded scenario and no failures: nothing to keep


def test_failed_ranks_carried_to_another_scenario_are_announced_with_those_dropped():
    from meshpact.app.state import carried_failures_notice

    said = carried_failures_notice("whatif_1024", "default", [5, 6, 7, 8, 9, 12], dropped=[600, 601, 602, 603])
    assert said == (
        "Failed ranks carried over from **whatif_1024**: 5-9, 12 (600-603 dropped: not in this mesh). "
        "Clear or change them on the Mesh page."
    )
    assert carried_failures_notice("default", "default", [5]) is None  # the same scenario
    assert carried_failures_notice(None, "default", [5]) is None  # the first scenario of the session
    assert carried_failures_notice("whatif_1024", "default", []) is None  # nothing to carry
    assert "carried over" in carried_failures_notice("a", "b", [], dropped=[70])  # every one dropped: still said


def test_the_replay_source_travels_in_the_link_by_a_short_word_and_back():
    from meshpact.app.state import REPLAY_SOURCES, replay_link_word, replay_source_from_link

    for word, source in REPLAY_SOURCES.items():
        assert replay_link_word(source) == word and replay_source_from_link(word) == source
    assert replay_source_from_link("failures picked on Mesh") is None and replay_source_from_link(None) is None
    assert replay_link_word("something else") is None
