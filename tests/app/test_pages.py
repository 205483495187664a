"""Every dashboard page through Streamlit's AppTest, on the default scenario."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

MAIN = str(Path(__file__).resolve().parents[2] / "app" / "main.py")
PAGES = ["views/mesh.py", "views/plans.py", "views/simulate.py", "views/replay.py", "views/live.py"]


def _app() -> AppTest:
    return AppTest.from_file(MAIN, default_timeout=60).run()


def _metric(at: AppTest, label: str) -> str:
    for m in at.metric:
        if m.label == label:
            return m.value
    raise AssertionError(f"no metric {label!r}; have {[m.label for m in at.metric]}")


@pytest.fixture(scope="module")
def app() -> AppTest:
    return _app()


@pytest.mark.parametrize("page", PAGES)
def test_page_renders_without_exception(app, page):
    app.switch_page(page).run()
    assert not app.exception, [e.value for e in app.exception]
    assert app.title, "every page has a title"


def _fail(at: AppTest, text: str) -> AppTest:
    return at.text_input(key="failed_ranks_text").input(text).run()


def test_typed_ranks_change_the_surviving_count_exactly():
    at = _app()
    assert _metric(at, "healthy ranks") == "32/32"
    _fail(at, "3, 17")
    assert not at.exception
    assert _metric(at, "healthy ranks") == "30/32"
    assert _metric(at, "communicators intact") == "1/3"
    _fail(at, "5")  # rank 5 alone, not 5, 15 and 25
    assert at.session_state["failed_ranks"] == [5]
    assert _metric(at, "healthy ranks") == "31/32"
    _fail(at, "5-9, 12")
    assert at.session_state["failed_ranks"] == [5, 6, 7, 8, 9, 12]
    assert at.text_input(key="failed_ranks_text").value == "5-9, 12"


def test_a_mistyped_rank_is_one_readable_line_and_keeps_the_failures():
    at = _app()
    _fail(at, "4")
    _fail(at, "4, 99")
    assert not at.exception
    assert [e.value for e in at.error] == ["rank 99 is not in this mesh (ranks 0-31)"]
    assert at.session_state["failed_ranks"] == [4]
    assert _metric(at, "healthy ranks") == "31/32"


def test_a_failure_shows_each_policy_and_the_downtime_reduction():
    at = _app()
    _fail(at, "5")
    reduction = _metric(at, "downtime reduction (cold restart ÷ in-memory)")
    assert reduction.endswith("×") and float(reduction[:-1]) > 1.0
    assert _metric(at, "state retained in memory") == "32/32 ranks"
    at.toggle[0].set_value(True).run()  # the failed rank's process is gone: its state is not retained
    assert _metric(at, "state retained in memory") == "31/32 ranks"
    assert len(at.get("download_button")) == 1  # the comparison as CSV


def test_a_lost_domain_refuses_in_memory_and_says_why():
    at = _app()
    _fail(at, "16-31")  # every rank of cann@hostB
    assert not at.exception
    assert _metric(at, "in-memory rebind") == "cannot apply"
    warnings = " ".join(w.value for w in at.warning)
    assert "in-memory rebind cannot apply" in warnings and "cann@hostB" in warnings
    assert "excise and continue cannot apply" in warnings
    assert _metric(at, "state retained in memory") == "0/32 ranks"


def test_failed_bridge_rank_hands_the_bridge_over():
    at = _app()
    _fail(at, "16")
    assert any("rank 17 takes over the bridge" in i.value for i in at.info)


def test_scenario_failed_ranks_and_replay_source_survive_page_switches():
    at = _app()
    at.selectbox(key="scenario_builtin").set_value("whatif_1024").run()
    _fail(at, "5, 600-603")
    at.switch_page("views/replay.py").run()
    at.radio(key="replay_source").set_value("recording").run()
    for page in ("views/plans.py", "views/simulate.py", "views/live.py", "views/mesh.py"):
        at.switch_page(page).run()
        assert not at.exception, page
        assert at.selectbox(key="scenario_builtin").value == "whatif_1024", page
    assert at.text_input(key="failed_ranks_text").value == "5, 600-603"
    assert _metric(at, "healthy ranks") == "1,019/1,024"
    at.switch_page("views/replay.py").run()
    assert at.radio(key="replay_source").value == "recording"


def test_a_bad_scenario_file_shows_a_readable_error(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: broken\ncluster:\n  domains:\n    - {name: a, vendor: tpu, host: h, ranks: 4}\n")
    at = _app()
    at.radio(key="scenario_source").set_value("path").run()
    at.text_input(key="scenario_path").input(str(bad)).run()
    assert not at.exception
    text = " ".join(e.value for e in at.error).replace("\\", "")  # Markdown escapes
    assert "bad.yaml" in text and "cluster.domains.0.vendor" in text and "tpu" in text
    at.text_input(key="scenario_path").input(str(tmp_path / "missing.yaml")).run()
    assert "no such scenario file" in " ".join(e.value for e in at.error)


def test_a_good_scenario_file_replaces_the_mesh(tmp_path):
    good = tmp_path / "small.yaml"
    good.write_text(
        "name: small\ncluster:\n  domains:\n    - {name: cpu@h, vendor: cpu, host: h, ranks: 4}\n"
        "    - {name: cuda@h, vendor: cuda, host: h, ranks: 4}\n"
    )
    at = _app()
    at.radio(key="scenario_source").set_value("path").run()
    at.text_input(key="scenario_path").input(str(good)).run()
    assert not at.exception
    assert _metric(at, "healthy ranks") == "8/8"
    assert at.session_state["failed_ranks"] == []


def test_replay_steps_through_a_simulated_recovery():
    at = _app()
    at.switch_page("views/replay.py").run()
    assert not at.exception
    assert _metric(at, "failed ranks") != "none"  # it opens on the first recovery
    assert _metric(at, "stage") == "replay"  # its last stage: every stage is on the chart
    assert at.slider(key="replay_index").min == 1  # the slider counts events as the label does
    at.slider(key="replay_index").set_value(2).run()
    assert _metric(at, "stage") == "detection"
    assert any(m.value.startswith("**Event 2/") for m in at.markdown)


def test_simulate_shows_goodput_per_policy_and_runs_the_serving_sweep():
    at = _app()
    at.switch_page("views/simulate.py").run()
    assert not at.exception
    goodput = {m.label: float(m.value.rstrip("%")) for m in at.metric}
    assert set(goodput) == {
        "cold restart",
        "checkpoint restore (in job)",
        "in-memory rebind",
        "peer restore",
        "excise and continue",
    }
    assert goodput["in-memory rebind"] > goodput["cold restart"]
    charts = len(at.get("plotly_chart"))
    at.button[0].click().run()  # Run serving sweep
    assert not at.exception
    assert len(at.get("plotly_chart")) == charts + 1


def test_simulate_refuses_a_number_out_of_range_in_words_and_draws_no_figure_for_it():
    """days = 0.2 once left the figures on the old value while the box showed 0.2, with a red "!"."""
    at = _app()
    at.switch_page("views/simulate.py").run()
    before = len(at.get("plotly_chart"))
    at.text_input(key="sim_days").input("0.2").run()
    assert not at.exception
    said = [e.value for e in at.error]
    assert any("**days**" in e and "0.2" in e and "from 0.5 to 60" in e for e in said), said
    assert before > 0 and len(at.get("plotly_chart")) == 0 and not at.metric
    at.text_input(key="sim_days").input("3").run()
    assert not at.exception and len(at.get("plotly_chart")) == before


# The planners the Plans page compares, as a user reads them: a planner dropped from the
# registry must fail this test, not shrink it.
PLANNER_HEADINGS = {"meshpact lowerer", "layout-only", "byte-only"}


def test_plans_page_shows_a_verdict_per_planner():
    at = _app()
    at.switch_page("views/plans.py").run()
    assert not at.exception
    headings = {m.value.lstrip("# ").strip() for m in at.markdown if m.value.startswith("####")}
    assert PLANNER_HEADINGS <= headings, headings
    passed = [e.value for e in at.success if "verdict" in e.value]
    rejected = [e.value for e in at.error if "verdict" in e.value]
    assert len(passed) + len(rejected) == len(PLANNER_HEADINGS)
    assert passed, "the lowerer's plan of the default edge passes the checker"


def test_plans_page_reports_impossible_facts_readably():
    at = _app()
    at.switch_page("views/plans.py").run()
    if any(r.key == "plans_source" for r in at.radio):  # the real-edge catalog is present
        at.radio(key="plans_source").set_value("build an edge from facts").run()
    at.selectbox(key="plans_request").set_value("reduced").run()  # needs a Partial producer
    assert not at.exception
    assert any("reduced request reads a Partial producer" in e.value for e in at.error)
    at.selectbox(key="plans_placement").set_value("Partial(sum)").run()
    assert not any("do not make an edge" in e.value for e in at.error)
    assert any("passes" in s.value for s in at.success)


@pytest.mark.slow
def test_every_real_edge_gets_a_verdict_per_planner():
    from meshpact.app.planning import real_edges

    edges = real_edges()
    assert len(edges) >= 9, f"the catalog of real edges holds {len(edges)}; the Plans page offers nine"
    at = _app()
    at.switch_page("views/plans.py").run()
    for name in edges:
        at.selectbox(key="plans_edge").set_value(name).run()
        assert not at.exception, name
        verdicts = [e.value for e in at.success] + [e.value for e in at.error]
        assert len([v for v in verdicts if "verdict" in v]) == len(PLANNER_HEADINGS), name
        assert any("passes" in s.value for s in at.success), f"{name}: the lowerer's plan must pass"


def test_replay_plays_the_shipped_live_recording():
    at = _app()
    at.switch_page("views/replay.py").run()
    at.radio(key="replay_source").set_value("recording").run()
    shipped = [o for o in at.selectbox(key="replay_recording").options if o.endswith("live-trial-2-ranks.jsonl")]
    assert shipped, at.selectbox(key="replay_recording").options
    at.selectbox(key="replay_recording").set_value(shipped[0]).run()
    assert not at.exception and not at.error
    at.slider(key="replay_index").set_value(5).run()  # the injected fault, the fifth event
    assert _metric(at, "failed ranks") == "rank 0"
    trace = json.loads(_perfetto(at))
    assert {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"} == {
        "job",
        "rank 0",
        "rank 1",
    }


def _perfetto(at: AppTest) -> str:
    """The Perfetto download of the recording the Replay page shows (what its button serves)."""
    from meshpact.app.exports import perfetto_json
    from meshpact.core.recording import read_recording

    buttons = [b for b in at.get("download_button") if "Perfetto" in b.proto.label]
    assert len(buttons) == 1
    shown = at.selectbox(key="replay_recording").value
    assert shown is not None
    return perfetto_json(read_recording(shown))


def test_mesh_failures_replay_through_the_cost_model():
    at = _app()
    _fail(at, "16-31")
    at.button[0].click().run()  # Replay these failures
    assert not at.exception
    assert at.radio(key="replay_source").value == "failures picked on Mesh"
    assert _metric(at, "failed ranks") == "ranks 16-31"
    # in-memory rebind cannot apply to a lost domain (no copy survives in memory); peer restore can, since its
    # copies sit on the other host
    assert at.selectbox(key="replay_policy").options == ["cold restart", "checkpoint restore (in job)", "peer restore"]


def test_replay_of_a_missing_recording_is_a_readable_error(tmp_path):
    at = _app()
    at.switch_page("views/replay.py").run()
    at.radio(key="replay_source").set_value("recording").run()
    at.selectbox(key="replay_recording").set_value("another file…").run()
    at.text_input(key="replay_path").input(str(tmp_path / "nope.jsonl")).run()
    assert not at.exception
    assert any("no such file" in e.value for e in at.error)


@pytest.mark.slow
@pytest.mark.live
@pytest.mark.timeout(240)
def test_live_page_runs_a_recovery_and_shows_the_verdict():
    at = _app()
    at.switch_page("views/live.py").run()
    for key, value in (("live_ranks", "2.5"), ("live_steps", "8"), ("live_faults", "1"), ("live_every", "2")):
        at.text_input(key=key).set_value(value)
    at.button[0].click().run()  # a number the box does not take is refused in words, nothing started
    assert any(
        "**ranks**: 2.5 is not a whole number; expected a whole number from 2 to 8" in e.value for e in at.error
    ), [e.value for e in at.error]
    assert "live_job" not in at.session_state
    at.text_input(key="live_ranks").set_value("2")
    at.toggle(key="live_baselines").set_value(False)
    at.toggle(key="live_hold").set_value(False)  # the planned fault alone, nothing sent by hand
    at.selectbox(key="live_pace_start").set_value("full speed")
    at.button[0].click().run()  # Start cluster and train
    assert not at.error, [e.value for e in at.error]
    deadline = time.monotonic() + 200
    while time.monotonic() < deadline and not _metric(at, "run").startswith("ended"):
        assert not at.exception, [e.message for e in at.exception]
        time.sleep(2)
        at.run()
    assert _metric(at, "run") == "ended (0)", [e.value for e in at.error]
    assert any("Bit-identical" in s.value for s in at.success), [e.value for e in at.error]
    assert _metric(at, "downtime: in-memory rebind").endswith(" s")
    assert not next(b for b in at.button if "Start" in b.proto.label).disabled  # the run ended: Start is back
    assert next(b for b in at.button if b.proto.label == "Stop").disabled
    assert any(b.proto.label == "Replay this run" for b in at.button)
    job = at.session_state["live_job"]
    assert job.recording.exists()
    job.recording.unlink()


def test_picking_a_model_sets_the_columns_of_a_hand_built_edge():
    at = _app()
    at.switch_page("views/plans.py").run()
    if any(r.key == "plans_source" for r in at.radio):
        at.radio(key="plans_source").set_value("build an edge from facts").run()
    at.selectbox(key="plans_model").set_value("MiniMaxAI/MiniMax-M2").run()
    assert at.number_input(key="plans_cols").value == 200064  # its vocab_size
    assert not at.exception


def test_the_link_opens_on_its_scenario_and_failed_ranks_and_keeps_up_with_them():
    at = AppTest.from_file(MAIN, default_timeout=60)
    at.query_params["scenario"] = "whatif_1024"
    at.query_params["failed"] = "5,600-603"
    at.run()
    assert not at.exception and not at.warning
    assert at.selectbox(key="scenario_builtin").value == "whatif_1024"
    assert _metric(at, "healthy ranks") == "1,019/1,024"
    assert at.query_params["failed"] == "5, 600-603"  # written back as the text box writes it
    _fail(at, "7-9")
    assert at.query_params["failed"] == "7-9" and at.query_params["scenario"] == "whatif_1024"
    _fail(at, "")
    assert "failed" not in at.query_params
    at.switch_page("views/replay.py").run()  # another page keeps them in its link too
    assert at.query_params["scenario"] == "whatif_1024"


def test_a_bad_link_is_one_line_per_value_and_the_defaults():
    at = AppTest.from_file(MAIN, default_timeout=60)
    at.query_params["scenario"] = "no_such_scenario"
    at.query_params["failed"] = "5,x-"
    at.run()
    assert not at.exception
    lines = [w.value for w in at.warning]
    assert len(lines) == 2 and all("\n" not in w for w in lines), lines
    assert "no_such_scenario" in lines[0] and "'x-' is not a rank or a range" in lines[1]
    assert _metric(at, "healthy ranks") == "32/32"
    assert at.query_params["scenario"] == "default" and "failed" not in at.query_params
    at.run()
    assert not at.warning  # said once


def _one_line(errors) -> str:  # noqa: ANN001 (AppTest's error elements)
    """The one error the page shows, past its bold heading; it must be one line."""
    assert len(errors) == 1, [e.value for e in errors]
    text = errors[0].value.split("\n\n")[1 if errors[0].value.startswith("**") else 0]
    assert "\n" not in text.strip() and "Traceback" not in text, errors[0].value
    return text.replace("\\", "")  # Markdown escapes


def _files(tmp_path: Path) -> dict[str, Path]:
    """A binary file, an empty one, a huge one (sparse: no disk), a directory and a NumPy array."""
    import numpy as np

    out = {
        "binary": tmp_path / "bin.dat",
        "empty": tmp_path / "empty.yaml",
        "huge": tmp_path / "huge.jsonl",
        "directory": tmp_path,
        "npy": tmp_path / "v.npy",
    }
    out["binary"].write_bytes(bytes(range(256)) * 8)
    out["empty"].write_bytes(b"")
    with out["huge"].open("wb") as fh:
        fh.truncate(1 << 30)
    np.save(out["npy"], np.zeros(4))
    return out


def test_any_file_in_the_scenario_path_box_is_one_line(tmp_path):
    at = _app()
    at.radio(key="scenario_source").set_value("path").run()
    for what, path in _files(tmp_path).items():
        at.text_input(key="scenario_path").input(str(path)).run()
        assert not at.exception, what
        text = _one_line(at.error)
        assert path.name in text and "expected a YAML scenario" in text or "directory" in text, (what, text)


def test_any_file_in_the_replay_path_box_is_one_line(tmp_path):
    at = _app()
    at.switch_page("views/replay.py").run()
    at.radio(key="replay_source").set_value("recording").run()
    at.selectbox(key="replay_recording").set_value("another file…").run()
    for what, path in _files(tmp_path).items():
        at.text_input(key="replay_path").input(str(path)).run()
        assert not at.exception, what
        text = _one_line(at.error)
        assert path.name in text and ("recording" in text or "event" in text), (what, text)
        if what == "huge":
            assert "at most" in text  # refused by its size, unread
