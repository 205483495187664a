"""Workloads: the user's own training loop, as a Python file the recovery trial runs.

A workload file defines three functions and, optionally, the mesh it wants::

    MESH = {"shape": [2, 2], "names": ["replicate", "shard"]}   # default: 1-D over all ranks

    def build(mesh):                      # -> (model, optimizer), sharded over ``mesh``
    def batch(step, rank):                # -> the batch of ``step`` on ``rank``: a pure function,
                                          #    so a restarted process can draw it again
    def train_step(model, optimizer, batch):   # -> the loss; forward, backward, optimizer step
    def state(rank):                      # optional -> {name: object with state_dict/load_state_dict}:
                                          #    registered with resilient(state=...), so batch may draw
                                          #    from them (a StatefulDataLoader) instead of being pure

:func:`check_workload` reads the file without running it (syntax, the three functions and
their parameters, ``MESH`` against the number of ranks, imports that cannot be found) and
then imports it and draws ``batch(0, 0)``; every mistake is one :class:`WorkloadError`
line naming what is wrong and what was expected, raised before any rank starts.
:func:`load_workload` is what each rank calls; it also checks what ``build`` returned.

The shipped workloads live in ``meshpact/scenarios/workloads/``; :func:`resolve_workload`
accepts their names (``decoder``, ``llama_hsdp``, ``compiled``) as well as paths.
"""

from __future__ import annotations

import ast
import importlib.util
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

from meshpact.core.errors import MeshpactError

__all__ = [
    "WorkloadError",
    "MeshSpec",
    "Workload",
    "resolve_workload",
    "shipped_workloads",
    "check_workload",
    "load_workload",
    "built",
    "DEFAULT_WORKLOAD",
]

DEFAULT_WORKLOAD = "decoder"
_FUNCTIONS = {"build": ("mesh",), "batch": ("step", "rank"), "train_step": ("model", "optimizer", "batch")}


class WorkloadError(MeshpactError):
    """A workload file cannot be run: the message names what is missing and what was expected."""


@dataclass(frozen=True)
class MeshSpec:
    """The DeviceMesh a workload asks for: its shape and dimension names (outermost first)."""

    shape: tuple[int, ...]
    names: tuple[str, ...] | None = None

    @classmethod
    def one_d(cls, ranks: int) -> "MeshSpec":
        return cls((ranks,), None)


@dataclass(frozen=True)
class Workload:
    """A loaded workload: the user's three functions and the mesh they run on."""

    path: str
    mesh: MeshSpec
    build: Callable[[Any], tuple[Any, Any]]
    batch: Callable[[int, int], Any]
    train_step: Callable[[Any, Any, Any], Any]
    state: Callable[[int], dict[str, Any]] | None = None  # the objects a rank registers as state


def _workloads_dir() -> Path:
    import meshpact.scenarios

    return Path(meshpact.scenarios.__file__).parent / "workloads"


def shipped_workloads() -> tuple[str, ...]:
    """The names of the workloads shipped with Meshpact."""
    return tuple(sorted(p.stem for p in _workloads_dir().glob("*.py") if not p.name.startswith("_")))


def resolve_workload(spec: str | Path) -> Path:
    """A shipped workload's name, or a path to a ``.py`` file, as an absolute path."""
    text = str(spec)
    if text in shipped_workloads():
        return _workloads_dir() / f"{text}.py"
    path = Path(text).expanduser()
    if not path.is_file():
        raise WorkloadError(
            f"--workload {text}: no such file; give a path to a .py file or one of the shipped "
            f"workloads ({', '.join(shipped_workloads())})"
        )
    if path.suffix != ".py":
        raise WorkloadError(f"--workload {text}: expected a Python file (.py) defining build, batch and train_step")
    return path.resolve()


def _mesh_from(value: Any, where: str, ranks: int) -> MeshSpec:
    if not isinstance(value, dict) or set(value) - {"shape", "names"} or "shape" not in value:
        raise WorkloadError(
            f'{where}: MESH must be a dict like {{"shape": [2, 2], "names": ["replicate", "shard"]}}, got {value!r}'
        )
    shape, names = value["shape"], value.get("names")
    if (
        not isinstance(shape, (list, tuple))
        or not shape
        or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in shape)
    ):
        raise WorkloadError(f"{where}: MESH shape must be a non-empty list of positive integers, got {shape!r}")
    if math.prod(shape) != ranks:
        raise WorkloadError(
            f"{where}: MESH shape {list(shape)} holds {math.prod(shape)} ranks but --ranks is "
            f"{ranks}; make the shape's product equal --ranks"
        )
    if names is not None:
        if (
            not isinstance(names, (list, tuple))
            or len(names) != len(shape)
            or not all(isinstance(n, str) and n for n in names)
            or len(set(names)) != len(names)
        ):
            raise WorkloadError(
                f"{where}: MESH names must be {len(shape)} distinct non-empty strings (one per "
                f"dimension of shape {list(shape)}), got {names!r}"
            )
        names = tuple(names)
    return MeshSpec(tuple(shape), names)


def _static_check(path: Path, ranks: int) -> MeshSpec:
    """Everything that can be checked without running the file."""
    where = str(path)
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=where)
    except SyntaxError as exc:
        raise WorkloadError(f"{where}:{exc.lineno}: syntax error: {exc.msg}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise WorkloadError(f"{where}: cannot be read ({exc})") from None
    defs = {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    for name, params in _FUNCTIONS.items():
        fn_node = defs.get(name)
        if fn_node is None:
            raise WorkloadError(
                f"{where}: missing function {name}({', '.join(params)}); a workload defines "
                "build(mesh), batch(step, rank) and train_step(model, optimizer, batch)"
            )
        positional = [a.arg for a in (*fn_node.args.posonlyargs, *fn_node.args.args)]
        required = len(positional) - len(fn_node.args.defaults)
        if required > len(params) or (len(positional) < len(params) and fn_node.args.vararg is None):
            raise WorkloadError(
                f"{where}:{fn_node.lineno}: {name} takes ({', '.join(positional)}); expected "
                f"{name}({', '.join(params)})"
            )
    mesh = MeshSpec.one_d(ranks)
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "MESH" for t in node.targets):
            try:
                value = ast.literal_eval(node.value)
            except ValueError:
                raise WorkloadError(f"{where}:{node.lineno}: MESH must be a literal dict of shape and names") from None
            mesh = _mesh_from(value, f"{where}:{node.lineno}", ranks)
    for node in tree.body:
        if isinstance(node, ast.Import):
            modules = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules = [node.module]
        else:
            continue
        for module in modules:
            top = module.split(".")[0]
            if top not in sys.modules and importlib.util.find_spec(top) is None:
                raise WorkloadError(
                    f"{where}:{node.lineno}: cannot import {module!r} (no module {top!r} is installed in this Python)"
                )
    return mesh


def _import(path: Path) -> ModuleType:
    name = f"meshpact_workload_{abs(hash(str(path))):x}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise WorkloadError(f"{path}: cannot be loaded as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001  (whatever the user's file raises is reported as one line)
        sys.modules.pop(name, None)
        raise WorkloadError(f"{path}: importing it failed: {type(exc).__name__}: {exc}") from None
    return module


def check_workload(spec: str | Path, ranks: int) -> Workload:
    """Resolve, read and import a workload file in this process and draw ``batch(0, 0)``; raise
    :class:`WorkloadError` (one line) on anything a rank would trip over."""
    path = resolve_workload(spec)
    mesh = _static_check(path, ranks)
    workload = _load(path, mesh)
    try:
        first = workload.batch(0, 0)
    except Exception as exc:  # noqa: BLE001
        raise WorkloadError(f"{path}: batch(0, 0) raised {type(exc).__name__}: {exc}") from None
    if first is None:
        raise WorkloadError(f"{path}: batch(0, 0) returned None; expected the batch of step 0 on rank 0")
    return workload


def _load(path: Path, mesh: MeshSpec) -> Workload:
    module = _import(path)
    for name in _FUNCTIONS:
        if not callable(getattr(module, name, None)):
            raise WorkloadError(f"{path}: {name} is not a function after import")
    state = getattr(module, "state", None)
    return Workload(str(path), mesh, module.build, module.batch, module.train_step, state if callable(state) else None)


def load_workload(path: str | Path, ranks: int) -> Workload:
    """What a rank runs: the file checked (without drawing a batch) and imported."""
    resolved = resolve_workload(path)
    return _load(resolved, _static_check(resolved, ranks))


def built(workload: Workload, mesh: Any) -> tuple[Any, Any]:
    """``workload.build(mesh)``, checked: a ``torch.nn.Module`` (or a list of them: pipeline
    parallel's model parts on this rank) and a ``torch.optim.Optimizer``."""
    import torch

    out = workload.build(mesh)
    model = out[0] if isinstance(out, tuple) and out else None
    parts = model if isinstance(model, list) and model else [model]
    if (
        not isinstance(out, tuple)
        or len(out) != 2
        or not all(isinstance(m, torch.nn.Module) for m in parts)
        or not isinstance(out[1], torch.optim.Optimizer)
    ):
        got = type(out).__name__ if not isinstance(out, tuple) else f"({', '.join(type(x).__name__ for x in out)})"
        raise WorkloadError(
            f"{workload.path}: build(mesh) returned {got}; expected (model, optimizer): a "
            "torch.nn.Module (or a list of model parts) and a torch.optim.Optimizer"
        )
    return out
