"""The Live page in a real browser: what it shows is what the run recorded, and it stops what it started.

Lean runs (2 ranks, a few steps, no checkpoint baselines, full speed): the faulted run is held
before its first step, a rank is killed from its row, and once the run is over the page's
downtime, committed step and per-rank states are checked against the run's JSON summary (the
summary event of its recording, the same document ``meshpact live recover --json`` prints).
While the replace run is held, its Prometheus endpoint is scraped: the step, and the
recovery once the page shows it; once it is over it opens as a Perfetto trace and in Replay.
Then Stop reads stopped (every rank stopped with its last step, none failed), and reloading
the page ends every process the page started, counted by PID among the dashboard server's
descendants, and says so on the page that opens.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from meshpact.app.format import duration
from meshpact.app.live_job import TRIAL_DIR
from meshpact.app.figures import LIVE_LABEL_PX
from meshpact.app.format import clock
from meshpact.app.serve import CLIPPED_JS, MESH_READABLE_JS, go_to, metric, wait_metric, wait_metric_is, wait_title
from meshpact.core.recovery import Policy
from meshpact.live.trials.trialconfig import PROCESSES_FILE

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.live]

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "test-artifacts"  # screenshots
RANKS, STEPS = 2, 4
RUNNER = "meshpact.app.live_job"  # the page's runner: python -m meshpact.app.live_job
# every metric and button, and besides them the widget labels and the rank table's cells
LIVE_CLIPPED_JS = CLIPPED_JS.replace(
    '\'[data-testid="stMetricValue"] div,',
    '\'[data-testid="stWidgetLabel"] p, [class*="st-key-live_row_"] p, [data-testid="stMetricValue"] div,',
)
assert LIVE_CLIPPED_JS != CLIPPED_JS, "the selector list of CLIPPED_JS changed: widen LIVE_CLIPPED_JS again"


def _row(pg, rank: int) -> list[str]:  # noqa: ANN001 (a playwright Page)
    box = pg.locator(f".st-key-live_row_{rank}")
    return [c.strip() for c in box.first.inner_text().split("\n") if c.strip()] if box.count() else []


def _rows_until(pg, ok, timeout_s: float) -> dict[int, list[str]]:  # noqa: ANN001
    """The rank table once ``ok(rows)`` holds (a fragment's rerun may show an older row for a moment)."""
    deadline = time.monotonic() + timeout_s
    while True:
        rows = {r: _row(pg, r) for r in range(RANKS)}
        if all(len(c) > 5 for c in rows.values()) and ok(rows):
            return rows
        errors = pg.locator('[data-testid="stAlertContentError"]').all_inner_texts()
        assert not errors, errors
        if time.monotonic() > deadline:
            raise AssertionError(f"the rank table never settled: {rows}")
        pg.wait_for_timeout(250)


def _click(pg, key: str, timeout_ms: int = 120_000) -> None:  # noqa: ANN001
    pg.wait_for_function(
        "(k) => { const b = document.querySelector(`.st-key-${k} button`); return b && !b.disabled; }",
        arg=key,
        timeout=timeout_ms,
    )
    pg.locator(f".st-key-{key} button").first.click()


def _start(pg, on_rank_loss: str = "replace") -> None:  # noqa: ANN001
    go_to(pg, "Live", "Live")
    form = pg.locator('[data-testid="stForm"]')
    form.get_by_label("ranks", exact=True).fill(str(RANKS))
    form.get_by_label("training steps", exact=True).fill(str(STEPS))
    form.get_by_label("checkpoint every (steps)", exact=True).fill(str(STEPS))
    form.get_by_text("checkpoint baselines", exact=True).click()  # off: the run is the reference and the faulted one
    pg.locator(".st-key-live_pace_start input").click()
    pg.get_by_role("option", name="full speed", exact=True).click()
    if on_rank_loss != "replace":  # the planned fault kind left at its default: no fault is planned
        pg.locator(".st-key-live_on_rank_loss input").click()
        pg.get_by_role("option", name=on_rank_loss, exact=True).click()
    form.get_by_role("button", name="Start cluster and train").click()


def _scrape(url: str) -> dict[str, float]:
    import urllib.request

    with urllib.request.urlopen(url, timeout=5) as r:
        lines = r.read().decode().splitlines()
    return {name: float(value) for name, _, value in (ln.rpartition(" ") for ln in lines if ln.startswith("meshpact_"))}


def _recorded(pg) -> list[dict]:  # noqa: ANN001
    """The events of the recording the page names."""
    saved = pg.locator("p", has_text="Recording saved:").locator("code").first.inner_text().strip()
    return [json.loads(ln) for ln in (ROOT / saved).read_text().splitlines() if ln.strip()]


def _summary(pg) -> dict:  # noqa: ANN001
    """The run's JSON summary: the summary event of the recording the page names."""
    return next(ln["data"] for ln in _recorded(pg) if ln["event"] == "summary")


VIEWPORTS = ({"width": 1400, "height": 900}, {"width": 1024, "height": 768})


def _mesh_reads(pg, failed: set[int]) -> None:  # noqa: ANN001
    """The Live mesh at this width: every rank that is not failed labelled in type a person reads, no
    marker over another, the plot not a sliver."""
    pg.locator(".st-key-live_mesh").scroll_into_view_if_needed()
    pg.wait_for_timeout(300)  # plotly redraws at the new width
    seen = pg.evaluate(MESH_READABLE_JS, ".st-key-live_mesh")
    assert seen is not None and seen["width"] >= 300, seen
    labels = dict(seen["labels"])
    assert set(labels) == {str(r) for r in range(RANKS) if r not in failed}, seen
    assert min(labels.values()) >= LIVE_LABEL_PX and seen["overlaps"] == 0, seen


@pytest.fixture
def its_recordings(request):
    """Removes, after the test, the recordings its runs began (a run this file starts: these ranks
    and steps) and left in the dashboard's recordings folder; a failed test's are moved to the
    test artifacts instead, so its failure can be read event by event."""
    folder, t0 = ROOT / "recordings", time.time()
    yield
    failed = getattr(request.node, "call_failed", False)  # set by tests/app/conftest.py
    for path in folder.glob("live-*.jsonl*"):
        try:
            if path.stat().st_mtime < t0:
                continue
            start = json.loads(path.read_text().splitlines()[0])["data"]
        except (OSError, ValueError, IndexError, KeyError):
            continue
        if (start.get("ranks"), start.get("steps")) == (RANKS, STEPS):
            if failed:
                ARTIFACTS.mkdir(exist_ok=True)
                path.replace(ARTIFACTS / path.name)
                print(f"kept the failed test's recording: {ARTIFACTS / path.name}")
            else:
                path.unlink(missing_ok=True)


@pytest.mark.timeout(420)
@pytest.mark.parametrize("on_rank_loss", ["replace", "excise"])
def test_a_kill_from_the_page_shows_what_the_runs_summary_says(user, on_rank_loss, its_recordings):
    pg = user
    _start(pg, on_rank_loss)
    _rows_until(pg, lambda rows: all(c[3] == "held" for c in rows.values()), 240)
    if on_rank_loss == "replace":
        pg.wait_for_timeout(300)  # fonts and layout settle
        assert pg.evaluate(LIVE_CLIPPED_JS) == [], "the Live console, held, cuts what a user reads"
        pg.locator(".st-key-live_metrics_on label").first.click()
        url = pg.locator("p", has_text="Scrape").locator("code").first.inner_text(timeout=30_000).strip()
        assert _scrape(url)['meshpact_committed_step{rank="0",run="faulted"}'] == 0.0  # held at its first step
    _click(pg, "live_kill_1")
    # sent before Resume is pressed: a click while the page still runs the kill's rerun would interrupt it
    pg.wait_for_function("() => document.body.innerText.includes('Sent from this page: kill rank 1')", timeout=60_000)
    if on_rank_loss == "excise":  # no replacement comes: the held survivor meets the loss itself, excises, holds again
        _rows_until(pg, lambda rows: rows[0][5] == "1" and rows[0][3] == "held" and rows[1][3] == "excised", 120)
    if on_rank_loss == "replace":  # recovered while held (the replacement joins the held survivor): generation 1
        _rows_until(pg, lambda rows: rows[0][5] == "1" and rows[0][3] == "held", 180)
        t0 = time.monotonic()
        scraped = _scrape(url)  # mid-run: the recovery is there as soon as the ranks' logs say so
        assert time.monotonic() - t0 < 2.0
        assert scraped['meshpact_recoveries_total{policy="peer_restore"}'] == 1.0, scraped
        assert scraped['meshpact_generation{rank="0",run="faulted"}'] == 1.0
        assert scraped['meshpact_rank_stage_seconds_count{stage="consensus"}'] >= 1.0
    _click(pg, "live_resume")
    verdict = pg.locator('[data-testid="stAlertContentSuccess"]', has_text="Bit-identical")
    verdict.wait_for(timeout=240_000)
    said = verdict.first.inner_text()
    assert pg.locator('[data-testid="stException"]').count() == 0
    # the verdict is drawn from the run's summary as soon as it is written; the runner's exit a moment later
    assert wait_metric_is(pg, "run", "ended (0)") == "ended (0)"
    summary = _summary(pg)
    policy = Policy.PEER_RESTORE if on_rank_loss == "replace" else Policy.EXCISE
    assert summary["faults_injected"] == summary["faults_recovered"] == 1, summary
    assert summary["downtime_s"][policy.value] is not None, summary
    assert wait_metric(pg, f"downtime: {policy.label}") == duration(summary["downtime_s"][policy.value])
    shown = {p.label for p in Policy if metric(pg, f"downtime: {p.label}") is not None}
    assert shown == {Policy(p).label for p, s in summary["downtime_s"].items() if s is not None}
    assert metric(pg, "committed step") == str(summary["steps"])  # every rank still in the job finished
    rows = _rows_until(pg, lambda rows: all(c[3] in ("done", "excised") for c in rows.values()), 30)
    recorded = _recorded(pg)
    kill = next(e for e in recorded if e["event"] == "fault_injected" and e["data"].get("source") == "dashboard")
    # one clock: the fault sent from the page reads at its time on the recording, as every event does
    assert pg.locator("p", has_text=f"Sent from this page: kill rank 1 at {clock(kill['t'])} ").count() == 1
    includes = summary["downtime_includes"][policy.value]
    assert pg.locator("p", has_text=f"{policy.label} includes {includes}").count() == 1  # on the page itself
    for viewport in VIEWPORTS:
        pg.set_viewport_size(viewport)
        _mesh_reads(pg, {1} if on_rank_loss == "excise" else set())
        pg.wait_for_timeout(300)
        assert pg.evaluate(LIVE_CLIPPED_JS) == [], f"the finished Live page cuts what a user reads at {viewport}"
    if on_rank_loss == "excise":  # judged against the excising reference, its difference from the unfailed run said
        excision = summary["excision"]
        assert said.startswith("Bit-identical to the excising reference") and excision["equal_to_excising_reference"]
        assert "without rank 1 from step" in said and "equal the fault-free" not in said
        assert f"{excision['max_abs_diff_from_unfailed']:.3g}" in said, (said, excision)
        assert "An excising run measures no checkpoint baseline" not in pg.locator("body").inner_text()  # none asked
    else:
        assert said.startswith("Bit-identical to the fault-free reference") and summary["excision"] is None
        # Prometheus's stage figures are the page's: each recovery's critical path, from the run's own analysis
        recs = [e["data"] for e in recorded if e["event"] == "recovered"]
        scraped = _scrape(url)
        for stage in ("detection", "consensus", "state"):
            want = sum(r["stages_s"][stage] or 0.0 for r in recs)
            assert abs(scraped.get(f'meshpact_stage_seconds_sum{{stage="{stage}"}}', 0.0) - want) < 1e-6, (stage, recs)
    ARTIFACTS.mkdir(exist_ok=True)
    pg.set_viewport_size({"width": 1400, "height": 2600})  # the app scrolls inside its own box: all of it in view
    pg.wait_for_timeout(500)
    pg.screenshot(path=str(ARTIFACTS / f"live-{on_rank_loss}-verdict.png"))
    if on_rank_loss == "excise":
        lost = {r for e in summary["excision"]["excisions"] for r in e["lost"]}
        assert lost == {1}
        assert {r for r, c in rows.items() if c[3] == "excised"} == lost
        assert sum(c[3] == "done" for c in rows.values()) == summary["final_world_size"] == RANKS - 1
    else:
        assert [c[3] for c in rows.values()] == ["done"] * RANKS
        assert summary["final_world_size"] == RANKS
        assert [r for r, c in rows.items() if c[2] != "0"] == [1] == [1] * summary["replacement_processes"]
        _the_run_opens_as_a_trace_and_in_replay(pg)


def _the_run_opens_as_a_trace_and_in_replay(pg) -> None:  # noqa: ANN001
    """The finished run as a Perfetto trace (a track per rank, the kill sent from the page on
    rank 1's, the recovery's stages), and the same run in Replay giving the same trace."""
    saved = pg.locator("p", has_text="Recording saved:").locator("code").first.inner_text().strip()
    with pg.expect_download(timeout=60_000) as dl:
        pg.locator(".st-key-live_perfetto button").first.click()
    trace = json.loads(Path(dl.value.path()).read_text())["traceEvents"]
    tracks = {e["args"]["name"]: e["tid"] for e in trace if e.get("name") == "thread_name"}
    assert {f"rank {r}" for r in range(RANKS)} <= set(tracks)
    assert any(
        e["name"] == "fault_injected" and e["tid"] == tracks["rank 1"] and e["args"].get("source") == "dashboard"
        for e in trace
    )
    assert {e["name"] for e in trace if e.get("cat") == "recovery"} >= {"consensus", "communicator", "state"}
    _click(pg, "live_replay")
    wait_title(pg, "Replay")
    assert Path(saved).name in pg.locator(".st-key-replay_recording input").first.input_value()
    with pg.expect_download(timeout=60_000) as dl2:
        pg.get_by_role("button", name="Perfetto trace (a track per rank)").click()
    again = json.loads(Path(dl2.value.path()).read_text())["traceEvents"]
    assert [e for e in again if e["name"] == "fault_injected"] == [e for e in trace if e["name"] == "fault_injected"]
    assert pg.locator('[data-testid="stException"]').count() == 0


def _children() -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            out.setdefault(ppid, []).append(int(entry.name))
    return out


def _server_pid(url: str, timeout_s: float = 5.0) -> int:
    """The dashboard server: the streamlit process serving ``url``'s port that this process (the
    ``server`` fixture) started. A process the server has just forked to start a runner shows the
    server's command line until it execs, and once the PID counter has wrapped (at 32,768 here, every
    10 to 20 minutes under load) its PID is lower than the server's, so it comes first in /proc:
    the command line alone can name the runner, whose descendants are then counted without it."""
    port, me = url.rsplit(":", 1)[1].encode(), os.getpid()
    deadline = time.monotonic() + timeout_s
    while True:
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    cmd = (entry / "cmdline").read_bytes().split(b"\0")
                    ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                except (OSError, IndexError, ValueError):
                    continue
                if ppid == me and any(c.endswith(b"streamlit") for c in cmd) and port in cmd:
                    return int(entry.name)
        if time.monotonic() > deadline:
            raise LookupError(f"no streamlit process started by this one serves {url}")
        time.sleep(0.1)


def _descendants(pid: int) -> set[int]:
    tree, out, todo = _children(), set(), [pid]
    while todo:
        for child in tree.get(todo.pop(), []):
            out.add(child)
            todo.append(child)
    return out


def _alive(pids: set[int]) -> set[int]:
    """Those of ``pids`` still running or left unreaped (a zombie)."""
    return {p for p in pids if Path(f"/proc/{p}").exists()}


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0").replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "(gone)"


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "gone"


class Seen:
    """What the test saw of the page's processes while it waited, for an assertion to tell: each
    descendant of the dashboard server, its command line, when it was first and last seen; the
    runner's work directory once a runner showed (its log, the launcher's list of the processes
    it started, the rank logs); and the page."""

    def __init__(self, server_pid: int) -> None:
        self.server_pid = server_pid
        self.t0 = time.monotonic()
        self.first: dict[int, float] = {}
        self.last: dict[int, float] = {}
        self.cmd: dict[int, str] = {}
        self.most = 0
        self.work: list[Path] = []

    def look(self) -> set[int]:
        procs = _descendants(self.server_pid)
        now = time.monotonic() - self.t0
        for p in procs:
            self.first.setdefault(p, now)
            self.last[p] = now
            cmd = _cmdline(p)  # read again each look: a process forked a moment ago may not have exec'd yet
            if cmd != "(gone)":
                self.cmd[p] = cmd
            self.cmd.setdefault(p, cmd)
            args = self.cmd[p].split()
            if RUNNER in args and "--result" in args:
                work = Path(args[args.index("--result") + 1]).parent
                if work not in self.work:
                    self.work.append(work)
        self.most = max(self.most, len(procs))
        return procs

    def runners(self, pids: set[int]) -> list[int]:
        return [p for p in pids if RUNNER in self.cmd.get(p, "").split()]

    def story(self, pg=None) -> str:  # noqa: ANN001 (a playwright Page)
        lines = [
            f"dashboard server {self.server_pid}; after {time.monotonic() - self.t0:.1f} s, at most {self.most} "
            "of its descendants at once; seen (pid [state] first-last seen: command line):"
        ]
        lines += [
            f"  {p} [{_state(p)}] {self.first[p]:.1f}-{self.last[p]:.1f} s: {self.cmd[p][:160]}"
            for p in sorted(self.first, key=self.first.__getitem__)
        ]
        for work in self.work:
            for name in ("runner.log", f"{TRIAL_DIR}/{PROCESSES_FILE}", "result.json"):
                try:
                    text = (work / name).read_text(errors="replace")[-2500:]
                except OSError as exc:
                    text = f"({exc.strerror})"
                lines.append(f"{work / name}:\n{text}")
            for log in sorted((work / TRIAL_DIR).glob("*/events-rank*.jsonl")):
                events = log.read_text(errors="replace").splitlines()
                lines.append(f"{log}: {len(events)} events, the last: {events[-1:]}")
        if pg is not None:
            try:
                lines.append("the page: " + pg.locator('[data-testid="stMain"]').first.inner_text(timeout=5_000)[:1500])
            except Exception as exc:  # noqa: BLE001 (playwright's errors): the story says what it could not read
                lines.append(f"the page could not be read: {exc}")
        return "\n".join(lines)


def _started_by_the_page(seen: Seen, at_least: int, timeout_s: float = 120) -> set[int]:
    """The server's descendants once there are ``at_least`` of them (or when ``timeout_s`` ran out)."""
    deadline = time.monotonic() + timeout_s
    while True:
        procs = seen.look()
        if len(procs) >= at_least or time.monotonic() > deadline:
            return procs
        time.sleep(0.25)


@pytest.mark.timeout(240)
def test_stop_reads_stopped_and_a_reload_ends_every_process_the_page_started(browser, server, its_recordings):
    server_pid = _server_pid(server)
    pg = browser.new_page(viewport={"width": 1400, "height": 900})
    pg.goto(server)
    go_to(pg, "Live", "Live")  # a number the form does not take: refused in words, nothing started
    pg.locator('[data-testid="stForm"]').get_by_label("ranks", exact=True).fill("2.5")
    pg.locator('[data-testid="stForm"]').get_by_role("button", name="Start cluster and train").click()
    pg.locator('[data-testid="stAlertContentError"]', has_text="2.5 is not a whole number").wait_for(timeout=30_000)
    assert not _descendants(server_pid)
    _start(pg)
    seen = Seen(server_pid)
    assert len(_started_by_the_page(seen, 2)) >= 2, seen.story(pg)  # the runner and its fork server at least
    _rows_until(pg, lambda rows: True, 120)  # the reference run's ranks are up
    _click(pg, "live_stop")
    pg.wait_for_function("() => document.body.innerText.includes('The run was stopped.')", timeout=60_000)
    assert metric(pg, "run") == "stopped" and metric(pg, "phase") == "stopped"
    assert pg.locator('[data-testid="stAlertContentError"]').count() == 0
    # a stop loses no rank: every row reads stopped with its last step, the mesh marks none failed. The
    # reference run is four steps long, so a rank may have ended its last step as the stop came: done, not lost
    rows = _rows_until(pg, lambda rows: {c[3] for c in rows.values()} <= {"stopped", "done"}, 30)
    steps = [int(c[4]) for c in rows.values() if c[4].isdigit()]
    assert metric(pg, "committed step") == (str(min(steps)) if steps else "—"), rows
    for viewport in VIEWPORTS:
        pg.set_viewport_size(viewport)
        _mesh_reads(pg, set())
    pg.wait_for_function(
        "() => !document.querySelector('.st-key-live_stop button') "
        "|| document.querySelector('.st-key-live_stop button').disabled",
        timeout=30_000,
    )
    pg.close()

    pg = browser.new_page(viewport={"width": 1400, "height": 900})
    pg.goto(server)
    _start(pg)
    seen = Seen(server_pid)
    started = _started_by_the_page(seen, RANKS + 2)  # the runner, its fork server and the reference run's ranks
    assert len(started) >= RANKS + 2 and len(seen.runners(started)) == 1, seen.story(pg)
    name = Path(seen.cmd[seen.runners(started)[0]].split("--record")[1].split()[0]).stem
    pg.reload()  # the session that started the run goes (as when its tab closes); the page that opens says so
    pg.locator(
        '[data-testid="stAlertContentWarning"]',
        has_text=f"The run {name} that this tab started was stopped when the page was reloaded",
    ).wait_for(timeout=30_000)
    pg.close()
    t0 = time.monotonic()
    while _alive(started) and time.monotonic() - t0 < 10:
        time.sleep(0.2)
    left = _alive(started)
    assert not left, {p: _cmdline(p)[:80] for p in left}
    assert _server_pid(server) == server_pid
    assert not _descendants(server_pid), seen.story()
