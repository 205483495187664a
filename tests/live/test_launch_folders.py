"""An agent that ends leaves no folder of its own behind: the warm spares' assignments and the refusal
markers live in temporary folders that exist only while they are used, and an agent asked about a
refusal after its shutdown does not make its marker folder again. (An agent killed with SIGKILL
cleans nothing: its refusal folder stays, empty.)"""

from __future__ import annotations

import tempfile
import types
from pathlib import Path

from meshpact.live.launch import sparepool
from meshpact.live.launch.processes import Running
from meshpact.live.launch.replacement import Replacements
from meshpact.live.launch.sparepool import SparePool


def _made(root: Path) -> list[str]:
    return sorted(p.name.rsplit("-", 1)[0] for p in root.iterdir())


def test_a_pool_makes_its_folder_with_its_first_spare_and_clear_removes_it(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    started: list[tuple[str, ...]] = []

    def handler(exe, args, *rest):  # elastic's get_subprocess_handler, as far as the pool reads what it returns
        started.append(tuple(args))
        return types.SimpleNamespace(proc=types.SimpleNamespace(pid=4000 + len(started), poll=lambda: None))

    monkeypatch.setattr(sparepool, "get_subprocess_handler", handler)
    pool = SparePool()
    assert _made(tmp_path) == []  # an agent that keeps no spare makes no folder
    pool.start()
    pool.start()
    (folder,) = tmp_path.iterdir()
    assert folder.name.startswith("meshpact-spares-")
    assert [a[-1] for a in started] == [str(folder / "spare-0.json"), str(folder / "spare-1.json")]
    pool.clear()
    assert _made(tmp_path) == [] and len(pool) == 0
    pool.clear()  # twice, as an agent's shutdown and its caller both may
    pool.start()  # a pool used again makes a new folder
    assert _made(tmp_path) == ["meshpact-spares"]
    pool.clear()


def test_a_refusal_asked_after_the_agents_shutdown_makes_no_marker_folder(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    replacements = Replacements(1)
    replacements.ledger.running[0] = Running(types.SimpleNamespace(proc=types.SimpleNamespace(pid=1)), 0, "")
    assert replacements.refusal(0) is None and _made(tmp_path) == []  # no process was given a marker
    marker = replacements.marker_of(0, 0)
    marker.write_text("cannot recover in memory: no peer copies are kept\n")
    assert replacements.refusal(0) == "cannot recover in memory: no peer copies are kept"
    replacements.close()
    assert _made(tmp_path) == []
    assert replacements.refusal(0) is None and _made(tmp_path) == []
