"""The direction of imports: core imports nothing of the others and no torch; live/ has no import
circle, and the trial bench is a client of the recovery library that the library never imports."""

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
    bad = {
        n
        for n in _imports("core")
        if n.split(".")[0] == "torch" or n.startswith(("meshpact.simulator", "meshpact.live", "meshpact.app"))
    }
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
        "for room in ('recovery', 'launch', 'plans', 'spillover'):\n"
        "    pkg = importlib.import_module('meshpact.live.' + room)\n"
        "    assert dir(pkg) == sorted(pkg._EXPORTS), room\n"
        "print('torch' in sys.modules)\n"
        "from meshpact.live.recovery import FaultKind\n"
        "from meshpact.live.launch import LaunchedProcess\n"
        "print('torch' in sys.modules)\n"
        "for room in ('recovery', 'launch', 'plans', 'spillover'):\n"
        "    pkg = importlib.import_module('meshpact.live.' + room)\n"
        "    for name, module in pkg._EXPORTS.items():\n"
        "        assert getattr(pkg, name) is getattr(importlib.import_module(f'meshpact.live.{room}.{module}'), name)\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False", "ok"]


def test_live_holds_rooms_and_a_few_shared_one_file_helpers():
    """A launch, recovery or serving concept has a room; loose at the top are only what every room shares."""
    loose = sorted(p.name for p in (ROOT / "live").glob("*.py"))
    assert loose == ["__init__.py", "_lazy.py", "backends.py", "netns.py", "store.py"]
    rooms = sorted(p.name for p in (ROOT / "live").iterdir() if (p / "__init__.py").exists())
    assert rooms == ["launch", "plans", "recovery", "spillover", "trials"]


def _module_name(root: pathlib.Path, path: pathlib.Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return "meshpact." + ".".join(parts)


def import_graph(root: pathlib.Path) -> dict[str, set[str]]:
    """Module -> the modules of the same tree it imports, as ``meshpact.<dir>.<...>`` names: every
    import statement counts, at module level, inside functions or under ``TYPE_CHECKING``,
    relative or absolute; ``from pkg import name`` counts as importing ``pkg.name`` when that is
    a module of the tree, else ``pkg``."""
    modules = {_module_name(root, p): p for p in root.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            else:
                continue
            deps.update(t for t in targets if t in modules and t != name)
        graph[name] = deps
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def test_the_import_graph_sees_function_level_relative_and_absolute_imports(tmp_path):
    pkg = tmp_path / "live"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from .sub import b\n")
    (pkg / "sub" / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..c import X\n")
    (pkg / "c.py").write_text("import meshpact.live.a\nfrom meshpact.live.sub.b import Y\n")
    graph = import_graph(pkg)
    assert graph["meshpact.live.a"] == {"meshpact.live.sub.b"}
    assert graph["meshpact.live.sub.b"] == {"meshpact.live.c"}
    assert graph["meshpact.live.c"] == {"meshpact.live.a", "meshpact.live.sub.b"}
    assert circles(graph) == [["meshpact.live.a", "meshpact.live.c", "meshpact.live.sub.b"]]


def test_no_import_circle_among_the_modules_of_live():
    graph = import_graph(ROOT / "live")
    assert (
        "meshpact.live.launch.worker" in graph["meshpact.live.launch.forkserver"]
    )  # the graph reads function-level imports
    assert circles(graph) == []


def test_the_trial_bench_is_a_client_of_the_recovery_library_that_the_library_never_imports():
    graph = import_graph(ROOT / "live")
    recovery = {m for m in graph if m.startswith("meshpact.live.recovery")}
    trials = {m for m in graph if m.startswith("meshpact.live.trials")}
    assert recovery and trials
    assert {(m, d) for m in recovery for d in graph[m] if d in trials} == set()
    assert any(d in recovery for m in trials for d in graph[m])


def test_no_class_of_the_launch_room_is_over_250_lines():
    """The agent is split along its decisions (replace, promote a spare, announce gone, node loss)."""
    sizes = {
        f"{path.name}:{node.name}": node.end_lineno - node.lineno + 1
        for path in (ROOT / "live" / "launch").glob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ClassDef)
    }
    assert sizes["elastic.py:ReplacingAgent"] > 100  # the walk sees the agent
    assert {name: n for name, n in sizes.items() if n > 250} == {}
