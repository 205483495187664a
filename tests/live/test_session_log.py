"""A rank's event log while a recovery defers it: nothing written, nothing lost, order kept."""

import json

from meshpact.core.recording import EventKind
from meshpact.live.recovery.session import EventLog


def _log(tmp_path):
    log = EventLog(3)
    log.attach(tmp_path / "rank3.jsonl")
    return log


def _logged(tmp_path):
    return [json.loads(line)["event"] for line in (tmp_path / "rank3.jsonl").read_text().splitlines()]


def test_deferred_events_reach_the_log_in_order_on_flush_and_later_ones_at_once(tmp_path):
    log = _log(tmp_path)
    log.emit(EventKind.SESSION_START)
    with log.deferred():
        log.emit(EventKind.DETECTED, error="x")
        with log.deferred():  # deferring inside a deferral keeps what is deferred
            log.emit(EventKind.DECIDED, round=1)
            assert _logged(tmp_path) == ["session_start"]
            assert [e.event for e in log.events] == [EventKind.SESSION_START, EventKind.DETECTED, EventKind.DECIDED]
            log.flush()
            assert _logged(tmp_path) == ["session_start", "detected", "decided"]
            log.emit(EventKind.RECOVERY_DONE, generation=1)  # after a flush: written at once
            assert _logged(tmp_path)[-1] == "recovery_done"
    assert _logged(tmp_path) == ["session_start", "detected", "decided", "recovery_done"]  # nothing written twice


def test_events_deferred_when_the_block_raises_still_reach_the_log(tmp_path):
    log = _log(tmp_path)
    try:
        with log.deferred():
            log.emit(EventKind.DETECTED, error="x")
            raise RuntimeError("a recovery that failed")
    except RuntimeError:
        pass
    assert _logged(tmp_path) == ["detected"]
