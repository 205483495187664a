"""Replay frames from simulated timelines and live recordings."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import pytest

from meshpact.app.replay import find_recordings, from_recording, from_timeline, replay_frame
from meshpact.core.recording import Event, read_recording
from meshpact.core.recovery import Policy, Stage

SHIPPED = Path(str(resources.files("meshpact.scenarios").joinpath("recordings", "live-trial-2-ranks.jsonl")))


def _sim(t, kind, stage=None, dur=0.0, rank=7, policy="in_memory"):
    return {"t": t, "duration_s": dur, "policy": policy, "kind": kind, "stage": stage, "data": {"rank": rank}}


def test_simulated_recovery_fails_its_rank_until_the_next_fault():
    timeline = [
        _sim(10.0, "fault"),
        _sim(10.0, "stage", "detection", 5.0),
        _sim(15.0, "stage", "consensus", 0.2),
        _sim(15.2, "checkpoint", dur=3.0),  # dropped: not part of a replay
        _sim(99.0, "fault", rank=2),
        _sim(99.0, "stage", "detection", 5.0),
        _sim(50.0, "fault", policy="cold_restart"),  # another policy's timeline
    ]
    events = from_timeline(timeline, Policy.IN_MEMORY)
    assert [e.kind for e in events] == ["fault", "stage", "stage", "fault", "stage"]
    f = replay_frame(events, 2)
    assert f.failed == {7} and f.stage is Stage.CONSENSUS
    assert f.stages_so_far == {Stage.DETECTION: 5.0, Stage.CONSENSUS: 0.2}
    g = replay_frame(events, 4)
    assert g.failed == {2} and g.recoveries_before == 1 and g.stages_so_far == {Stage.DETECTION: 5.0}


def test_a_fault_during_a_recovery_joins_it():
    events = from_timeline(
        [
            _sim(0.0, "fault", rank=1),
            _sim(0.0, "stage", "detection", 5.0),
            _sim(2.0, "fault", rank=3),
            _sim(5.0, "stage", "consensus", 1.0),
        ]
    )
    f = replay_frame(events, 3)
    assert f.failed == {1, 3} and f.recoveries_before == 0


def _ev(t, event, rank=None, stage=None, **data):
    return Event(t=t, event=event, rank=rank, stage=Stage(stage) if stage else None, data=data)


def test_live_recording_takes_the_longest_rank_per_stage_and_the_decided_policy():
    events = from_recording(
        [
            _ev(0.0, "recording_start", source="live"),
            _ev(1.0, "fault_injected", rank=0, kind="collective"),
            _ev(1.1, "detected", 0, "detection", seconds=0.02),
            _ev(1.1, "detected", 1, "detection", seconds=0.05),
            _ev(1.3, "decided", 0, "consensus", seconds=0.1, policy="in_memory"),
            _ev(1.3, "decided", 1, "consensus", seconds=0.2, policy="in_memory"),
            _ev(2.0, "checkpoint", 1, step=8),
        ]
    )
    assert events[0].kind == "fault" and events[0].rank == 0
    f = replay_frame(events, 4)
    assert f.failed == {0} and f.policy is Policy.IN_MEMORY
    assert f.stages_so_far == {Stage.DETECTION: 0.05, Stage.CONSENSUS: 0.2}
    done = replay_frame(events, 5)
    assert done.failed == frozenset() and done.recoveries_before == 1


def test_the_shipped_live_recording_replays_two_recoveries():
    events = from_recording(read_recording(SHIPPED))
    frames = [replay_frame(events, i) for i in range(len(events))]
    assert {0} in [f.failed for f in frames]  # the injected fault on rank 0
    policies = [f.policy for f in frames if f.stage is Stage.CONSENSUS]
    assert Policy.IN_MEMORY in policies and Policy.CHECKPOINT_RESTORE in policies
    assert frames[-1].recoveries_before == 2


def test_nothing_to_replay_is_a_readable_error():
    with pytest.raises(ValueError, match="nothing to replay"):
        replay_frame([], 0)


def test_find_recordings_skips_partial_files(tmp_path):
    (tmp_path / "a.jsonl").write_text("{}\n")
    (tmp_path / "b.jsonl.partial").write_text("{}\n")
    assert [p.name for p in find_recordings([tmp_path, tmp_path / "missing"])] == ["a.jsonl"]


def test_a_live_recording_is_drawn_on_its_own_local_ranks():
    from meshpact.app.replay import recording_mesh
    from meshpact.core.scenario import default_scenario

    scenario_mesh = default_scenario().mesh()
    meta = dict(read_recording(SHIPPED)[0].data)
    mesh = recording_mesh(meta, scenario_mesh)
    assert mesh.world_size == 2 and mesh.domains[0].backend.value == "gloo"
    assert recording_mesh({"source": "simulated"}, scenario_mesh) is scenario_mesh


def test_a_replay_opens_on_the_last_stage_of_its_first_recovery():
    from meshpact.app.replay import first_recovery_index

    events = from_timeline(
        [
            _sim(1.0, "fault"),
            _sim(1.0, "stage", "detection", 5.0),
            _sim(6.0, "stage", "consensus", 1.0),
            _sim(50.0, "fault", rank=3),
            _sim(50.0, "stage", "detection", 5.0),
        ]
    )
    assert first_recovery_index(events) == 2
    assert first_recovery_index(from_timeline([_sim(1.0, "fault")])) == 0


def test_a_replay_finds_its_first_recovery_however_late_in_a_long_run():
    from meshpact.app.replay import first_recovery_index, replay_frame, replay_frames

    quiet = [_sim(float(t), "degraded", rank=None) for t in range(3000)]  # a long run of events before any fault
    late = from_timeline(
        quiet
        + [
            _sim(4000.0, "fault"),
            _sim(4000.0, "stage", "detection", 5.0),
            _sim(4005.0, "stage", "consensus", 1.0),
            _sim(4100.0, "fault", rank=3),
            _sim(4100.0, "stage", "detection", 5.0),
        ]
    )
    first = first_recovery_index(late)
    assert late[first].stage is not None and late[first].stage.value == "consensus"
    assert replay_frame(late, first).stages_so_far and replay_frame(late, first).recoveries_before == 0
    assert len(late) > 3000 and first > 3000  # far past where the page once stopped looking (400 events)
    frames = list(replay_frames(late))  # one pass gives what each single frame gives
    assert len(frames) == len(late)
    for i in (0, first, len(late) - 1):
        assert frames[i] == replay_frame(late, i)


@pytest.mark.parametrize("content", [b"\x89PNG\r\n\x1a\n\x00\xff\xfe", b"", b"\x00" * 70_000])
def test_any_file_given_as_a_recording_is_one_line(tmp_path, content):
    from meshpact.core.errors import MeshpactError

    p = tmp_path / "picture.jsonl"
    p.write_bytes(content)
    with pytest.raises(MeshpactError) as info:
        read_recording(p)
    assert "\n" not in str(info.value) and str(p) in str(info.value)


def test_a_file_that_is_no_recording_is_refused_with_what_it_is_and_what_was_expected(tmp_path):
    import json

    from meshpact.app.replay import recording_problem

    empty, obj, other = tmp_path / "empty.jsonl", tmp_path / "obj.json", tmp_path / "late.jsonl"
    empty.write_text("")
    obj.write_text(json.dumps({"name": "not a recording", "ranks": 4}) + "\n")
    other.write_text(json.dumps({"t": 0.0, "event": "step", "rank": 0, "stage": None, "data": {}}) + "\n")
    said = {p.name: recording_problem(p) for p in (tmp_path, empty, obj, other, tmp_path / "gone.jsonl")}
    assert "is a folder, not a recording" in said[tmp_path.name]
    assert "the file is empty" in said["empty.jsonl"]
    assert "line 1 is not an event (a JSON object with t, event" in said["obj.json"]
    assert "line 1 is a 'step' event, not 'recording_start'" in said["late.jsonl"]
    assert "no such file" in said["gone.jsonl"]
    assert all(s.count("\n") == 0 and "expected a .jsonl file" in s for s in said.values())
    shipped = Path(__file__).resolve().parents[2] / "scenarios" / "recordings" / "live-trial-2-ranks.jsonl"
    assert recording_problem(shipped) is None
