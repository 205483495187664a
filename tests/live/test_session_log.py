"""A rank's event log while a recovery holds it: nothing written, nothing lost, order kept."""

import json

from meshpact.core.recording import EventKind
from meshpact.live.recovery.config import RecoveryConfig
from meshpact.live.recovery.session import Session


def _session(tmp_path):
    s = Session(rank=3, world_size=4, config=RecoveryConfig(), store=None, control=None, spec=None, groups={},
                generation=0, incarnation=0, mesh_shape=(4,), mesh_names=None)
    s.attach_log(tmp_path / "rank3.jsonl")
    return s


def _logged(tmp_path):
    return [json.loads(line)["event"] for line in (tmp_path / "rank3.jsonl").read_text().splitlines()]


def test_held_events_reach_the_log_in_order_on_release_and_later_ones_at_once(tmp_path):
    s = _session(tmp_path)
    s.emit(EventKind.SESSION_START)
    s.hold_log()
    s.emit(EventKind.DETECTED, error="x")
    s.hold_log()  # holding twice keeps what is held
    s.emit(EventKind.DECIDED, round=1)
    assert _logged(tmp_path) == ["session_start"]
    assert [e.event for e in s.events] == [EventKind.SESSION_START, EventKind.DETECTED, EventKind.DECIDED]
    s.release_log()
    assert _logged(tmp_path) == ["session_start", "detected", "decided"]
    s.emit(EventKind.RECOVERY_DONE, generation=1)
    assert _logged(tmp_path)[-1] == "recovery_done"
    s.release_log()  # nothing held: nothing written twice
    assert _logged(tmp_path) == ["session_start", "detected", "decided", "recovery_done"]
