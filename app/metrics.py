"""Prometheus metrics of a live run, read from its records as they are written.

:class:`RecordingMetrics` follows a run's events the way the Live page does
(:class:`~meshpact.app.live_control.JobEvents`): every rank process's own log as the rank
writes it, and the trial parent's own events from the recording (the ``.partial`` file while
the run writes it, then the finished one); given only a recording, the recording. It keeps,
in its own registry: recoveries by the policy the ranks decided on (as each is decided),
each recovery's stage durations along its critical path as a histogram per stage (once the
trial's analysis writes its ``recovered`` events: the same figures the Live page draws), each
rank's own stage durations as another (as each stage ends on that rank), events
by kind, each rank's committed step and generation in the run it is in, each rank's seconds
since its last event, and each rank's heartbeat age (seconds since its heartbeat counter on
the control channel last moved) as the trial parent keeps it while the run runs
(:data:`~meshpact.live.trials.trialconfig.HEARTBEATS_FILE` in the run's folder): a rank that
stalls ages there at once, whatever it writes.
:class:`MetricsEndpoint` serves that registry over HTTP for Prometheus to scrape; it is
off until the Live page turns it on, binds to 127.0.0.1 unless told otherwise, and
re-reads the recording on every scrape, so the numbers are as fresh as the file.
"""

from __future__ import annotations

import json
import threading
import time
import weakref
from pathlib import Path
from typing import Any, Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from meshpact.app.live_control import JobEvents
from meshpact.core.recording import Event, EventKind
from meshpact.live.trials.trialconfig import HEARTBEATS_FILE  # torch-free

__all__ = ["RecordingMetrics", "MetricsEndpoint", "STAGE_BUCKETS_S"]

STAGE_BUCKETS_S = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


class _RankAges(Collector):
    """Gauges computed when scraped: each rank's step and generation, seconds since its last event, and its heartbeat age."""

    def __init__(self, owner: "RecordingMetrics") -> None:
        self.owner = owner

    def collect(self) -> Iterator[GaugeMetricFamily]:
        self.owner.poll()
        step = GaugeMetricFamily(
            "meshpact_committed_step", "The step a rank last committed, in the run it is in", labels=["run", "rank"]
        )
        generation = GaugeMetricFamily(
            "meshpact_generation",
            "The generation a rank's latest event names, in the run it is in",
            labels=["run", "rank"],
        )
        for (run, rank), value in sorted(self.owner.step.items()):
            step.add_metric([run, str(rank)], value)
        for (run, rank), value in sorted(self.owner.generation.items()):
            generation.add_metric([run, str(rank)], value)
        yield step
        yield generation
        last = GaugeMetricFamily(
            "meshpact_rank_last_event_age_seconds",
            "Seconds since the rank's last recorded event (wall clock)",
            labels=["rank"],
        )
        now = time.time()
        for rank, wall in sorted(self.owner.last_event_wall.items()):
            last.add_metric([str(rank)], max(now - wall, 0.0))
        yield last
        beat = GaugeMetricFamily(
            "meshpact_heartbeat_age_seconds",
            "Seconds since the rank's heartbeat counter on the control channel last moved",
            labels=["run", "rank"],
        )
        for (run, rank), age in sorted(self.owner.heartbeat_ages().items()):
            beat.add_metric([run, str(rank)], age)
        yield beat


def _seconds(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0


class RecordingMetrics:
    """The metrics of one run; :meth:`feed` takes events, :meth:`poll` reads new ones from its
    records (``trial_dir``: where the rank processes write their logs, when they do)."""

    def __init__(self, recording: Path, trial_dir: Path | None = None) -> None:
        self.recording = Path(recording)
        self.source = JobEvents(self.recording, trial_dir)
        self.trial_dir = Path(trial_dir) if trial_dir is not None else None
        self.registry = CollectorRegistry()
        self.registry.register(_RankAges(self))  # first: a scrape reads the file before any metric is collected
        self.recoveries = Counter(
            "meshpact_recoveries", "Recoveries, by the policy the ranks decided on", ["policy"], registry=self.registry
        )
        self.stage_seconds = Histogram(
            "meshpact_stage_seconds",
            "Duration of a recovery's stage along its critical path (each stage ends when "
            "the last rank ends it), once per recovery: the figures the Live page draws",
            ["stage"],
            buckets=STAGE_BUCKETS_S,
            registry=self.registry,
        )
        self.rank_stage_seconds = Histogram(
            "meshpact_rank_stage_seconds",
            "Duration of a recovery stage on one rank, as the rank measured it",
            ["stage"],
            buckets=STAGE_BUCKETS_S,
            registry=self.registry,
        )
        self.events = Counter("meshpact_events", "Recorded events, by kind", ["event"], registry=self.registry)
        self.last_event_wall: dict[int, float] = {}
        self.step: dict[tuple[str, int], int] = {}  # (run, rank) -> committed step
        self.generation: dict[tuple[str, int], int] = {}
        self._decisions: set[tuple[object, ...]] = set()
        self._lock = threading.Lock()

    def feed(
        self, events: Iterable[Event], run: str = "", wall0: float | None = None, wall_clock: bool = False
    ) -> None:
        """Count ``events``: their ``t`` is wall time (``wall_clock``, as in a rank's own log) or
        seconds since ``wall0`` (a recording's, learnt from its first event when not given; unknown:
        now); ``run``: the trial's run they belong to where the events do not say."""
        for e in events:
            self.events.labels(event=e.event).inc()
            if e.event == EventKind.RECORDING_START and isinstance(e.data.get("wall_time"), (int, float)):
                wall0 = float(e.data["wall_time"]) - e.t
            their_run = str(e.data.get("run") or run)
            if e.rank is not None:
                self.last_event_wall[e.rank] = e.t if wall_clock else e.t + wall0 if wall0 is not None else time.time()
                if e.event in (EventKind.STEP, EventKind.HELD) and isinstance(e.data.get("step"), int):
                    self.step[(their_run, e.rank)] = int(e.data["step"])
                if isinstance(e.data.get("generation"), int) and not isinstance(e.data.get("generation"), bool):
                    self.generation[(their_run, e.rank)] = int(e.data["generation"])
            secs = e.data.get("seconds")
            if e.stage is not None and secs is not None and _seconds(secs):
                self.rank_stage_seconds.labels(stage=e.stage.value).observe(float(secs))
            stages = e.data.get("stages_s")
            if e.event == EventKind.RECOVERED and isinstance(stages, dict):  # the trial's analysis, once per recovery
                for stage, value in stages.items():
                    if _seconds(value):
                        self.stage_seconds.labels(stage=str(stage)).observe(float(value))
            policy = e.data.get("policy")
            if e.event == EventKind.DECIDED and isinstance(policy, str):
                # every rank records the same decision: count it once per (run, round, step, policy, session)
                key = (their_run, policy, e.data.get("round"), e.data.get("step"), e.data.get("generation"))
                if key not in self._decisions:
                    self._decisions.add(key)
                    self.recoveries.labels(policy=policy).inc()

    def heartbeat_ages(self) -> dict[tuple[str, int], float]:
        """(run, rank) -> seconds since the rank's heartbeat last moved, now: the age the trial
        parent wrote plus the time since it wrote it (a parent that stopped writing ages them all)."""
        out: dict[tuple[str, int], float] = {}
        if self.trial_dir is None:
            return out
        now = time.time()
        for path in sorted(self.trial_dir.glob(f"*/{HEARTBEATS_FILE}")):
            try:
                doc = json.loads(path.read_text())
                written, ages = float(doc["t"]), dict(doc["ages_s"])
                for rank, age in ages.items():
                    out[(path.parent.name, int(rank))] = max(float(age) + now - written, 0.0)
            except (OSError, ValueError, KeyError, TypeError):
                continue  # being replaced, or not one of ours: the next scrape reads it
        return out

    def poll(self) -> int:
        """Read the events written since the last poll; returns how many."""
        with self._lock:
            rank_events, parent = self.source.poll()
            self.feed(parent, wall0=self.source.wall0)
            for re in rank_events:
                self.feed([re.event], run=re.phase, wall_clock=True)
            return len(rank_events) + len(parent)


class MetricsEndpoint:
    """An HTTP endpoint serving a recording's metrics at ``http://<addr>:<port>/metrics``."""

    def __init__(self, recording: Path, port: int = 0, addr: str = "127.0.0.1", trial_dir: Path | None = None) -> None:
        self.metrics = RecordingMetrics(recording, trial_dir)
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
