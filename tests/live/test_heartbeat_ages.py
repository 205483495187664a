"""The trial parent keeps each rank's heartbeat age (seconds since its counter on the control
channel last moved) in the run's folder while the run runs: what the dashboard's metrics read."""

from __future__ import annotations

import json
import time

from meshpact.core.recording import RecordingWriter
from meshpact.live.launch.launcher import host_store
from meshpact.live.recovery.control import ControlChannel
from meshpact.live.recovery.heartbeat import beat_key
from meshpact.live.trials.trial import LostRankWatch
from meshpact.live.trials.trialconfig import HEARTBEATS_FILE
from meshpact.live.recovery.jobkey import draw

KEY = draw("a test's job key")  # the job key the channels of this file sign with


def test_a_rank_whose_heartbeat_stops_ages_and_one_that_beats_stays_young(tmp_path):
    server = host_store("127.0.0.1", 0, 3)
    ranks = [ControlChannel("127.0.0.1", server.port, r, 2, timeout_s=2.0, run_id="faulted", key=KEY) for r in range(2)]
    observer = ControlChannel("127.0.0.1", server.port, 0, 2, timeout_s=2.0, run_id="faulted", key=KEY)
    ages = tmp_path / HEARTBEATS_FILE
    watch = LostRankWatch(observer, RecordingWriter(tmp_path / "r.jsonl", "live"), ages_file=ages)
    for ch in ranks:
        ch.add(beat_key(ch.rank), 1)
    watch.write_ages()
    first = json.loads(ages.read_text())
    assert set(first["ages_s"]) == {"0", "1"} and max(first["ages_s"].values()) < 0.5
    for _ in range(4):  # rank 0 beats on, rank 1 has stopped
        time.sleep(0.2)
        ranks[0].add(beat_key(0), 1)
        watch.write_ages()
    doc = json.loads(ages.read_text())
    assert doc["ages_s"]["0"] < 0.2 and doc["ages_s"]["1"] >= 0.8
    assert not ages.with_name(ages.name + ".partial").exists()
    # a rank that never beat has no age yet (not an age since the epoch)
    other = LostRankWatch(
        ControlChannel("127.0.0.1", server.port, 0, 3, timeout_s=2.0, run_id="fresh", key=KEY),
        RecordingWriter(tmp_path / "s.jsonl", "live"),
        ages_file=tmp_path / "fresh.json",
    )
    other.write_ages()
    assert json.loads((tmp_path / "fresh.json").read_text())["ages_s"] == {}
