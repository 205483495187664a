"""The ``meshpact`` command line.

Command groups: the planning commands at the top level (``plan``, ``edges``,
``transitions``), ``live`` (real process groups) and ``simulate`` (SimPy). Each command
lives in a module of :mod:`meshpact.commands` with a ``register(groups)`` function, and is
listed once in :data:`COMMANDS`; help listings show the first line of its docstring.

:func:`build` makes a fresh Typer app for one command line and imports only the module of
the command it names: ``meshpact plan ...`` never imports the simulator or torch, and
``meshpact --help`` imports no command module at all (the listing reads each command's
docstring from its source). User errors print their message and exit with status 2; no traceback.
A value Click refuses (an enum option, a number out of range, a missing option) is reported
the same way, as one line naming the option, the value and what it expects (:func:`usage_error_line`).
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from enum import Enum
from importlib import import_module
from importlib.util import find_spec
from pathlib import Path
from types import UnionType
from typing import Any, Callable, Literal, NoReturn, Sequence, Union, get_args, get_origin

import typer

from meshpact import __version__
from meshpact.core.errors import MeshpactError
from meshpact.exiting import run_then_exit

__all__ = ["CommandSpec", "COMMANDS", "GROUP_HELP", "Groups", "build", "main", "usage_error_line", "choices_of"]


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
    CommandSpec(None, "launch", "launch", "launch"),
    CommandSpec(None, "control-plane", "control_plane", "control_plane"),
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


def _listing_only(spec: CommandSpec) -> Callable[[], None]:
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
            no_args_is_help=True,
            add_completion=False,
            pretty_exceptions_enable=False,
            rich_markup_mode="rich",
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


# The exception classes of the Click that parses our command lines (Typer's own copy of Click
# in newer releases, Click itself in older ones), found from a public name of either.
_click_errors = sys.modules[typer.BadParameter.__module__]
_CLICK_ERROR: type[Exception] = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")


def _argument_value(param: Any, args: Sequence[str]) -> str | None:
    """The value given to ``param`` on the command line (its last occurrence), or None."""
    names = [*param.opts, *getattr(param, "secondary_opts", ())]
    value = None
    for i, arg in enumerate(args):
        if arg in names and i + 1 < len(args):
            value = args[i + 1]
        for name in names:
            if name.startswith("--") and arg.startswith(name + "="):
                value = arg[len(name) + 1 :]
    return value


def _declared_type(param: Any) -> Any:
    """The Python annotation a parameter was declared with (Optional unwrapped), or None."""
    annotation = getattr(getattr(param, "type_descriptor", None), "annotation", None)
    if get_origin(annotation) in (Union, UnionType):
        inner = [a for a in get_args(annotation) if a is not type(None)]
        annotation = inner[0] if len(inner) == 1 else annotation
    return annotation


def choices_of(param: Any) -> tuple[str, ...] | None:
    """The values an option accepts when it is declared as an Enum, a Literal or a Choice."""
    annotation = _declared_type(param)
    if isinstance(annotation, type) and issubclass(annotation, Enum):
        return tuple(str(m.value) for m in annotation)
    if get_origin(annotation) is Literal:
        return tuple(str(v) for v in get_args(annotation))
    choices = getattr(getattr(param, "type", None), "choices", None)
    return tuple(str(getattr(c, "value", c)) for c in choices) if choices else None


def _number_words(param: Any) -> str | None:
    """'an integer from 2 to 16', 'a number of at least 0.1', ... from the declared type and bounds."""
    annotation = _declared_type(param)
    low = getattr(param, "min", None)
    high = getattr(param, "max", None)
    if low is None and high is None:
        kind = getattr(param, "type", None)
        low, high = getattr(kind, "min", None), getattr(kind, "max", None)
        annotation = annotation or {"INT": int, "FLOAT": float}.get(getattr(kind, "name", "").upper())
    if annotation not in (int, float):
        return None
    what = "an integer" if annotation is int else "a number"
    if low is not None and high is not None:
        return f"{what} from {low} to {high}"
    if low is not None:
        return f"{what} of at least {low}"
    if high is not None:
        return f"{what} of at most {high}"
    return what


def usage_error_line(exc: Exception, args: Sequence[str]) -> str:
    """One line for a command line that Click refused: the option, the value given and what it
    expects, in the words of the project's own errors (``--name 'value': expected ...``)."""
    ctx = getattr(exc, "ctx", None)
    invoked = _invoked(args)
    command = ctx.command_path if ctx is not None else " ".join(["meshpact", *(invoked[0].path if invoked else ())])
    see = f"; see '{command} --help'"
    param = getattr(exc, "param", None)
    if isinstance(exc, _click_errors.MissingParameter) and param is not None:
        name = "/".join(param.opts) if param.param_type_name == "option" else param.human_readable_name
        return f"{name} is required{see}"
    if isinstance(exc, _click_errors.BadParameter) and param is not None:
        name = max(param.opts, key=len) if param.param_type_name == "option" else param.human_readable_name
        given = _argument_value(param, args)
        choices = choices_of(param)
        expected = f"one of {', '.join(choices)}" if choices else _number_words(param)
        if expected is None:
            return f"{name}: {' '.join(exc.message.split())}"
        return f"{name} {given!r}: expected {expected}" if given is not None else f"{name}: expected {expected}"
    if isinstance(exc, _click_errors.NoSuchOption):
        maybe = f" (did you mean {' or '.join(sorted(exc.possibilities))}?)" if exc.possibilities else ""
        return f"{exc.option_name}: no such option{maybe}{see}"
    if isinstance(exc, _click_errors.BadOptionUsage):
        message = " ".join(exc.message.split()).rstrip(".").replace(f"Option '{exc.option_name}' ", "")
        return f"{exc.option_name}: {message}{see}"
    assert isinstance(exc, _click_errors.ClickException)  # main() passes only Click's refusals
    return " ".join(exc.format_message().split()).rstrip(".") + see


def main(argv: list[str] | None = None) -> int:
    """Run one command line; user errors (ours and Click's alike) print one line and give 2."""
    args = list(sys.argv[1:] if argv is None else argv)
    cli = build(args)
    try:
        rv = cli(args=args, prog_name="meshpact", standalone_mode=False)
    except MeshpactError as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 2
    except _click_errors.NoArgsIsHelpError:  # a group named alone: its help, as before
        cli(args=[*args, "--help"], prog_name="meshpact", standalone_mode=False)
        return 2
    except _CLICK_ERROR as exc:
        sys.stderr.write(f"error: {usage_error_line(exc, args)}\n")
        return 2
    except typer.Abort:
        sys.stderr.write("aborted\n")
        return 1
    except SystemExit as exc:
        return int(exc.code or 0) if not isinstance(exc.code, str) else 1
    return rv if isinstance(rv, int) else 0  # typer.Exit(code) comes back as its code


def run() -> NoReturn:
    """The ``meshpact`` console script: :func:`main`, then the process ends (:mod:`meshpact.exiting`)."""
    run_then_exit(main)


if __name__ == "__main__":  # pragma: no cover
    run()
