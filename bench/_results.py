"""Where a benchmark's result goes: one JSON line on stdout, the same under bench/results/.

Every benchmark ends with :func:`emit`, which adds the facts a reader needs to weigh the
numbers (when they were taken, the load average, the machine, the command line and the
commit measured), prints the document as one JSON line, and writes it to
``bench/results/<name>.json``. The docs' results page is rendered from those files
(``scripts/render_results.py``), so a measurement is never copied into prose by hand.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / (1 << 20), 1)
    except (OSError, ValueError, IndexError):
        pass
    return None


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _commit(root: Path) -> str | None:
    try:
        out = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{out}+changes" if dirty else out


FAULT_TO_RUNNING = "fault_to_running_ms_p50_by_kind"
"""The headline key of every recovery bench: per fault kind, the median downtime a user sees,
from the fault's injection until every rank ran the next step (its first collective on the new
group, after any replay), detection included (``TrialResult.fault_to_running_ms``)."""


def p50_by_kind(ms_by_kind: dict[str, list[float]]) -> dict[str, float | None]:
    """The median of each kind's values (None where a kind has none): :data:`FAULT_TO_RUNNING`'s value."""
    return {kind: (statistics.median(ms) if ms else None) for kind, ms in ms_by_kind.items()}


def run_facts() -> dict[str, Any]:
    """When, where and on what a result was measured (the load average is read now, at the end:
    its 5- and 15-minute figures cover the run)."""
    script = Path(sys.argv[0]).resolve() if sys.argv and sys.argv[0] else None
    root = RESULTS.parent.parent
    try:
        command = " ".join(["python", script.relative_to(root).as_posix(), *sys.argv[1:]]) if script else None
    except ValueError:
        command = " ".join(sys.argv)
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "machine": {
            "cpus": os.cpu_count(),
            "cpu": _cpu_model(),
            "memory_gib": _memory_gib(),
            "system": f"{platform.system()} {platform.release()}",
            "python": platform.python_version(),
            "torch": _version("torch"),
        },
        "command": command,
        "commit": _commit(root),
    }


def emit(name: str, doc: dict[str, Any], results: Path = RESULTS) -> Path:
    """Print ``doc`` with the run's facts as one JSON line and write it to ``results/<name>.json``."""
    record = {**doc, "run": run_facts()}
    print(json.dumps(record, sort_keys=True, default=str, separators=(",", ":")), flush=True)
    results.mkdir(parents=True, exist_ok=True)
    path = results / f"{name}.json"
    partial = path.with_suffix(".json.partial")
    partial.write_text(json.dumps(record, sort_keys=True, default=str, indent=1) + "\n")
    os.replace(partial, path)
    return path
