"""The ``meshpact`` command line.

Command groups: the planning commands at the top level (``plan``, ``edges``,
``transitions``), ``live`` (real process groups) and ``simulate`` (SimPy). Each command
lives in a module of :mod:`meshpact.commands` with a ``register(groups)`` function, and is
listed once in :data:`COMMANDS`; help listings show the first line of its docstring.

:func:`build` makes a fresh Typer app for one command line and imports only the module of
the command it names: ``meshpact plan ...`` never imports the simulator or torch, and
``meshpact --help`` imports no command module at all (the listing reads each command's
docstring from its source). User errors print their message and exit with status 2; no traceback.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from importlib import import_module
from importlib.util import find_spec
from pathlib import Path
from typing import Sequence

import typer

from meshpact import __version__
from meshpact.core.errors import MeshpactError

__all__ = ["CommandSpec", "COMMANDS", "GROUP_HELP", "Groups", "build", "main"]


@dataclass(frozen=True)
class CommandSpec:
    """One command: where it sits (group or top level), its module and its function there."""

    group: str | None  # "live", "simulate", or None for the top level
    name: str
    module: str  # under meshpact.commands; its register(groups) adds the real command
    function: str  # the command's function in that module; its docstring is the help

    @property
    def path(self) -> tuple[str, ...]:
        return (self.name,) if self.group is None else (self.group, self.name)

    def summary(self) -> str:
        """The first line of the command's docstring, read from source without importing it."""
        spec = find_spec(f"meshpact.commands.{self.module}")
        assert spec is not None and spec.origin is not None, self.module
        tree = ast.parse(Path(spec.origin).read_text(encoding="utf-8"))
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name == self.function:
                return (ast.get_docstring(node) or "").strip().splitlines()[0]
        raise LookupError(f"meshpact.commands.{self.module} has no function {self.function!r}")


COMMANDS: tuple[CommandSpec, ...] = (
    CommandSpec(None, "plan", "plan", "plan"),
    CommandSpec(None, "edges", "plan", "edges"),
    CommandSpec(None, "transitions", "plan", "transitions"),
    CommandSpec("live", "bridge", "live_bridge", "bridge"),
    CommandSpec("live", "recover", "live_recover", "recover"),
    CommandSpec("live", "spillover", "live_spillover", "spillover"),
    CommandSpec("simulate", "training", "simulate", "training"),
    CommandSpec("simulate", "serving", "simulate", "serving"),
    CommandSpec("simulate", "sweep", "simulate", "sweep"),
)

GROUP_HELP: dict[str, str] = {
    "live": "Run on real process groups (gloo on CPU; nccl/hccl where present).",
    "simulate": "What-if analysis with the SimPy simulator.",
}


@dataclass(frozen=True)
class Groups:
    root: typer.Typer
    live: typer.Typer
    simulate: typer.Typer


def _version(value: bool) -> None:
    if value:
        typer.echo(f"meshpact {__version__}")
        raise typer.Exit()


def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
) -> None:
    """Meshpact: contracts, plans and in-memory recovery across native domains."""


def _invoked(argv: Sequence[str]) -> list[CommandSpec]:
    """The commands an argument list names: one, or none (a help listing or a usage error)."""
    words = [a for a in argv if not a.startswith("-")]
    for spec in COMMANDS:
        if tuple(words[: len(spec.path)]) == spec.path:
            return [spec]
    return []


def _listing_only(spec: CommandSpec) -> typer.models.CommandFunctionType:
    def listed() -> None:  # never runs: a named command is registered from its own module
        raise MeshpactError(f"command {' '.join(spec.path)} was not loaded")

    listed.__doc__ = spec.summary()
    return listed


def build(argv: Sequence[str] = ()) -> typer.Typer:
    """A fresh app for ``argv``: the named command from its module, the rest as listings."""
    groups = Groups(
        root=typer.Typer(
            name="meshpact",
            help="Plan, check and run communication across vendor boundaries; recover training in memory.",
            no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False, rich_markup_mode="rich",
        ),
        live=typer.Typer(help=GROUP_HELP["live"], no_args_is_help=True),
        simulate=typer.Typer(help=GROUP_HELP["simulate"], no_args_is_help=True),
    )
    groups.root.callback()(_root)
    invoked = _invoked(argv)
    for module in dict.fromkeys(spec.module for spec in invoked):
        import_module(f"meshpact.commands.{module}").register(groups)
    loaded = {spec.path for spec in COMMANDS if spec.module in {s.module for s in invoked}}
    for spec in COMMANDS:
        if spec.path not in loaded:
            target = groups.root if spec.group is None else getattr(groups, spec.group)
            target.command(spec.name)(_listing_only(spec))
    groups.root.add_typer(groups.live, name="live")
    groups.root.add_typer(groups.simulate, name="simulate")
    return groups.root


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    cli = build(args)
    try:
        cli(args=args, standalone_mode=True)
    except MeshpactError as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 2
    except SystemExit as exc:  # typer's normal exit path
        return int(exc.code or 0) if not isinstance(exc.code, str) else 1
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
