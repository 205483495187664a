"""The direction of imports: core imports nothing of the others and no torch."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _imports(package: str) -> set[str]:
    names: set[str] = set()
    for path in (ROOT / package).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module)
    return names


def test_core_imports_no_torch_and_no_sibling_package():
    bad = {n for n in _imports("core") if n.split(".")[0] == "torch" or n.startswith(
        ("meshpact.simulator", "meshpact.live", "meshpact.app"))}
    assert not bad


def test_simulator_and_live_do_not_import_each_other():
    assert not {n for n in _imports("simulator") if n.startswith("meshpact.live")}
    assert not {n for n in _imports("live") if n.startswith("meshpact.simulator")}


def test_importing_core_loads_no_torch():
    code = "import sys, meshpact.core, meshpact.core.scenario; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_each_live_room_exports_names_its_modules_define_and_loads_no_torch_to_list_them():
    code = (
        "import sys, importlib\n"
        "for room in ('recovery', 'plans', 'spillover'):\n"
        "    pkg = importlib.import_module('meshpact.live.' + room)\n"
        "    assert dir(pkg) == sorted(pkg._EXPORTS), room\n"
        "print('torch' in sys.modules)\n"
        "from meshpact.live.recovery import FaultKind\n"
        "print('torch' in sys.modules)\n"
        "for room in ('recovery', 'plans', 'spillover'):\n"
        "    pkg = importlib.import_module('meshpact.live.' + room)\n"
        "    for name, module in pkg._EXPORTS.items():\n"
        "        assert getattr(pkg, name) is getattr(importlib.import_module(f'meshpact.live.{room}.{module}'), name)\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False", "ok"]
