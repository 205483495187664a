"""Prometheus metrics of a live run, read from its recording as the recording grows.

:class:`RecordingMetrics` tails a recording (the ``.partial`` file while the run writes
it, then the finished one) and keeps, in its own registry: recoveries by the policy the
ranks decided on, the duration of every recovery stage as a histogram per stage,
recorded events by kind, each rank's seconds since its last recorded event, and the
heartbeat age a rank reported where an event carries one (``heartbeat_age_s``).
:class:`MetricsEndpoint` serves that registry over HTTP for Prometheus to scrape; it is
off until the Live page turns it on, binds to 127.0.0.1 unless told otherwise, and
re-reads the recording on every scrape, so the numbers are as fresh as the file.
"""

from __future__ import annotations

import threading
import time
import weakref
from pathlib import Path
from typing import Any, Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from meshpact.app.live_control import tail_events
from meshpact.core.recording import Event

__all__ = ["RecordingMetrics", "MetricsEndpoint", "STAGE_BUCKETS_S"]

STAGE_BUCKETS_S = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


class _RankAges(Collector):
    """Gauges computed when scraped: seconds since each rank's last event, and reported heartbeat ages."""

    def __init__(self, owner: "RecordingMetrics") -> None:
        self.owner = owner

    def collect(self) -> Iterator[GaugeMetricFamily]:
        self.owner.poll()
        last = GaugeMetricFamily("meshpact_rank_last_event_age_seconds",
                                 "Seconds since the rank's last recorded event (wall clock)", labels=["rank"])
        now = time.time()
        for rank, wall in sorted(self.owner.last_event_wall.items()):
            last.add_metric([str(rank)], max(now - wall, 0.0))
        yield last
        beat = GaugeMetricFamily("meshpact_heartbeat_age_seconds",
                                 "Heartbeat age a rank reported in its latest event that carries one",
                                 labels=["rank"])
        for rank, age in sorted(self.owner.heartbeat_age.items()):
            beat.add_metric([str(rank)], age)
        yield beat


class RecordingMetrics:
    """The metrics of one recording; :meth:`feed` takes events, :meth:`poll` reads new ones from the file."""

    def __init__(self, recording: Path) -> None:
        self.recording = Path(recording)
        self.registry = CollectorRegistry()
        self.registry.register(_RankAges(self))  # first: a scrape reads the file before any metric is collected
        self.recoveries = Counter("meshpact_recoveries", "Recoveries, by the policy the ranks decided on",
                                  ["policy"], registry=self.registry)
        self.stage_seconds = Histogram("meshpact_stage_seconds", "Duration of a recovery stage on one rank",
                                       ["stage"], buckets=STAGE_BUCKETS_S, registry=self.registry)
        self.events = Counter("meshpact_events", "Recorded events, by kind", ["event"], registry=self.registry)
        self.last_event_wall: dict[int, float] = {}
        self.heartbeat_age: dict[int, float] = {}
        self._decisions: set[tuple[object, ...]] = set()
        self._wall_start: float | None = None
        self._offset = 0
        self._lock = threading.Lock()

    def feed(self, events: Iterable[Event]) -> None:
        for e in events:
            self.events.labels(event=e.event).inc()
            if e.event == "recording_start" and isinstance(e.data.get("wall_time"), (int, float)):
                self._wall_start = float(e.data["wall_time"]) - e.t
            if e.rank is not None:
                self.last_event_wall[e.rank] = (self._wall_start + e.t) if self._wall_start is not None else time.time()
                age = e.data.get("heartbeat_age_s")
                if isinstance(age, (int, float)) and not isinstance(age, bool):
                    self.heartbeat_age[e.rank] = float(age)
            secs = e.data.get("seconds")
            if e.stage is not None and isinstance(secs, (int, float)) and not isinstance(secs, bool) and secs >= 0:
                self.stage_seconds.labels(stage=e.stage.value).observe(float(secs))
            policy = e.data.get("policy")
            if e.event == "decided" and isinstance(policy, str):
                # every rank records the same decision: count it once per (round, step, policy, session)
                key = (policy, e.data.get("round"), e.data.get("step"), e.data.get("generation"), e.data.get("run"))
                if key not in self._decisions:
                    self._decisions.add(key)
                    self.recoveries.labels(policy=policy).inc()

    def poll(self) -> int:
        """Read the events appended since the last poll; returns how many."""
        with self._lock:
            new, self._offset = tail_events(self.recording, self._offset)
            self.feed(new)
            return len(new)


class MetricsEndpoint:
    """An HTTP endpoint serving a recording's metrics at ``http://<addr>:<port>/metrics``."""

    def __init__(self, recording: Path, port: int = 0, addr: str = "127.0.0.1") -> None:
        self.metrics = RecordingMetrics(recording)
        self.metrics.poll()
        self._server, self._thread = start_http_server(int(port), addr=addr, registry=self.metrics.registry)
        self.addr, self.port = addr, int(self._server.server_port)
        # dropped with the browser session that opened it: the port is freed too
        self._finalizer = weakref.finalize(self, _shutdown, self._server, self._thread)

    @property
    def url(self) -> str:
        return f"http://{self.addr}:{self.port}/metrics"

    def close(self) -> None:
        self._finalizer()


def _shutdown(server: Any, thread: threading.Thread) -> None:
    server.shutdown()
    server.server_close()
    thread.join(timeout=5)
