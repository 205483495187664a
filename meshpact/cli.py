"""The ``meshpact`` command line.

Command groups: the planning commands at the top level (``plan``, ``edges``,
``transitions``), ``live`` (real process groups) and ``simulate`` (SimPy). Command
modules live in :mod:`meshpact.commands` and are listed in :data:`COMMAND_MODULES`.
User errors print their message and exit with status 2; no traceback.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from importlib import import_module

import typer

from meshpact import __version__
from meshpact.core.errors import MeshpactError

__all__ = ["app", "main", "Groups", "COMMAND_MODULES"]

# Modules under meshpact.commands, each with register(groups).
COMMAND_MODULES: tuple[str, ...] = ("simulate", "live_bridge", "plan", "live_recover", "live_spillover")

app = typer.Typer(
    name="meshpact",
    help="Plan, check and run communication across vendor boundaries; recover training in memory.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)


@dataclass(frozen=True)
class Groups:
    root: typer.Typer
    live: typer.Typer
    simulate: typer.Typer


def _version(value: bool) -> None:
    if value:
        typer.echo(f"meshpact {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
) -> None:
    """Meshpact: contracts, plans and in-memory recovery across native domains."""


def build() -> typer.Typer:
    groups = Groups(
        root=app,
        live=typer.Typer(help="Run on real process groups (gloo on CPU; nccl/hccl where present).", no_args_is_help=True),
        simulate=typer.Typer(help="What-if analysis with the SimPy simulator.", no_args_is_help=True),
    )
    for name in COMMAND_MODULES:
        import_module(f"meshpact.commands.{name}").register(groups)
    if groups.live.registered_commands:
        app.add_typer(groups.live, name="live")
    if groups.simulate.registered_commands:
        app.add_typer(groups.simulate, name="simulate")
    return app


def main(argv: list[str] | None = None) -> int:
    cli = build()
    try:
        cli(args=argv, standalone_mode=True)
    except MeshpactError as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 2
    except SystemExit as exc:  # typer's normal exit path
        return int(exc.code or 0) if not isinstance(exc.code, str) else 1
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
