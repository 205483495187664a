"""The Prometheus endpoint of a live run: fed from the recording as it grows, loopback only."""

from __future__ import annotations

import json
import time
import urllib.request

from meshpact.app.metrics import MetricsEndpoint
from meshpact.core.recording import partial_path
from meshpact.live.trials.trialconfig import HEARTBEATS_FILE


def _line(t, event, rank=None, stage=None, **data) -> str:
    return json.dumps({"t": t, "event": event, "rank": rank, "stage": stage, "data": data}) + "\n"


def _scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=5) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("meshpact_"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def test_metrics_follow_the_partial_recording_as_it_grows(tmp_path):
    final = tmp_path / "live-run.jsonl"
    partial = partial_path(final)
    partial.write_text(
        _line(0.0, "recording_start", source="live", ranks=3, wall_time=1000.0) + _line(1.0, "session_start", rank=0)
    )
    ep = MetricsEndpoint(final)
    try:
        assert ep.addr == "127.0.0.1" and ep.port > 0
        m = _scrape(ep.url)
        assert 'meshpact_events_total{event="session_start"}' in m
        assert not any(k.startswith("meshpact_recoveries_total") for k in m)
        with open(partial, "a") as fh:  # the run goes on: a recovery decided by all three ranks
            for rank in range(3):
                fh.write(_line(5.0, "detected", rank, "detection", seconds=0.02 * (rank + 1)))
                fh.write(_line(5.5, "decided", rank, "consensus", seconds=0.3, policy="in_memory", round=1, step=6))
            fh.write(_line(9.0, "decided", 1, "consensus", seconds=0.1, policy="checkpoint_restore", round=2, step=8))
            fh.write('{"t": 9.5, "event": "half a li')  # a line still being written is not read
        m = _scrape(ep.url)
        assert m['meshpact_recoveries_total{policy="in_memory"}'] == 1.0  # three ranks, one decision
        assert m['meshpact_recoveries_total{policy="checkpoint_restore"}'] == 1.0
        assert m['meshpact_rank_stage_seconds_count{stage="detection"}'] == 3.0
        assert abs(m['meshpact_rank_stage_seconds_sum{stage="detection"}'] - 0.12) < 1e-9
        assert m['meshpact_rank_stage_seconds_bucket{le="0.05",stage="detection"}'] == 2.0
        assert not any(k.startswith("meshpact_stage_seconds_count") for k in m)  # no recovery analysed yet
        assert 'meshpact_rank_last_event_age_seconds{rank="1"}' in m
        assert m['meshpact_events_total{event="decided"}'] == 4.0
    finally:
        ep.close()


def test_the_endpoint_stops_when_closed(tmp_path):
    rec = tmp_path / "r.jsonl"
    rec.write_text(_line(0.0, "recording_start"))
    ep = MetricsEndpoint(rec)
    url = ep.url
    ep.close()
    try:
        urllib.request.urlopen(url, timeout=2)
    except OSError:
        return
    raise AssertionError("the endpoint still answers after close()")


def test_a_dropped_endpoint_frees_its_port(tmp_path):
    import gc

    rec = tmp_path / "r.jsonl"
    rec.write_text(_line(0.0, "recording_start"))
    ep = MetricsEndpoint(rec)
    url = ep.url
    del ep
    gc.collect()
    try:
        urllib.request.urlopen(url, timeout=2)
    except OSError:
        return
    raise AssertionError("an endpoint nobody holds still answers")


def test_metrics_follow_the_rank_logs_while_the_run_goes(tmp_path):
    """Mid-run the recording holds only its start: the step, generation, a recovery and its
    stages come from the ranks' own logs as they write them, and the finished recording's
    copies of those logs are not counted again."""
    import os

    rec, trial = tmp_path / "live.jsonl", tmp_path / "trial"
    (trial / "faulted").mkdir(parents=True)
    partial_path(rec).write_text(_line(0.0, "recording_start", source="live", wall_time=1000.0))
    logs = [trial / "faulted" / f"events-rank{r}-0.jsonl" for r in range(2)]
    for r, log in enumerate(logs):
        log.write_text(_line(1001.0, "step", r, step=3, generation=0))
    ep = MetricsEndpoint(rec, trial_dir=trial)
    try:
        (trial / "faulted" / HEARTBEATS_FILE).write_text(
            json.dumps({"t": time.time() - 1.0, "ages_s": {"0": 0.1, "1": 4.0}})
        )
        m = _scrape(ep.url)
        assert m['meshpact_committed_step{rank="1",run="faulted"}'] == 3.0
        # as the trial parent last wrote them, aged by the second since: rank 1's heartbeat stopped
        assert 1.1 <= m['meshpact_heartbeat_age_seconds{rank="0",run="faulted"}'] < 1.5
        assert 5.0 <= m['meshpact_heartbeat_age_seconds{rank="1",run="faulted"}'] < 5.5
        assert not any(k.startswith("meshpact_recoveries_total") for k in m)
        for r, log in enumerate(logs):  # rank 1's peer died: both ranks detect, decide, and go on
            with open(log, "a") as fh:
                fh.write(_line(1002.0, "detected", r, "detection", seconds=0.2, step=4, generation=0))
                fh.write(
                    _line(
                        1002.5,
                        "decided",
                        r,
                        "consensus",
                        seconds=0.4,
                        policy="peer_restore",
                        round=1,
                        step=4,
                        generation=0,
                    )
                )
                fh.write(_line(1003.0, "step", r, step=5, generation=1))
        m = _scrape(ep.url)
        assert m['meshpact_recoveries_total{policy="peer_restore"}'] == 1.0
        assert m['meshpact_rank_stage_seconds_count{stage="consensus"}'] == 2.0
        assert m['meshpact_committed_step{rank="0",run="faulted"}'] == 5.0
        assert m['meshpact_generation{rank="0",run="faulted"}'] == 1.0
        events = m['meshpact_events_total{event="detected"}']
        with open(partial_path(rec), "a") as fh:  # the run ends: the parent copies the logs, then its summary
            for r in range(2):
                fh.write(_line(2.0, "detected", r, "detection", seconds=0.2))
            fh.write(
                _line(
                    3.5,
                    "recovered",
                    step=4,
                    generation=1,
                    policy="peer_restore",
                    stages_s={"detection": 0.25, "consensus": 0.5, "communicator": 0.125, "state": None},
                )
            )
            fh.write(_line(4.0, "summary", faults_injected=0))
        os.replace(partial_path(rec), rec)
        m = _scrape(ep.url)
        assert m['meshpact_events_total{event="detected"}'] == events == 2.0
        assert m['meshpact_events_total{event="summary"}'] == 1.0
        assert m['meshpact_rank_stage_seconds_count{stage="detection"}'] == 2.0
        # the recovery as the page draws it: one observation per stage, its critical-path figure
        assert m['meshpact_stage_seconds_count{stage="consensus"}'] == 1.0
        assert m['meshpact_stage_seconds_sum{stage="consensus"}'] == 0.5
        assert m['meshpact_stage_seconds_sum{stage="detection"}'] == 0.25
        assert 'meshpact_stage_seconds_count{stage="state"}' not in m  # not measured: no observation
    finally:
        ep.close()
