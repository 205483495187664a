"""Every value the command line refuses gets the project's one line, whichever command and option.

The options are found by introspecting the commands the CLI declares (:data:`COMMANDS`), so an
option added later is covered without a new test.
"""

from __future__ import annotations

from typing import Any

import pytest
import typer.main

from meshpact.cli import COMMANDS, build, choices_of, main


def _declared_options() -> list[tuple[tuple[str, ...], Any]]:
    out: list[tuple[tuple[str, ...], Any]] = []
    for spec in COMMANDS:
        cmd: Any = typer.main.get_command(build(list(spec.path)))
        for word in spec.path:
            cmd = cmd.commands[word]
        out += [(spec.path, p) for p in cmd.params if p.param_type_name == "option"]
    return out


OPTIONS = _declared_options()
ENUM_OPTIONS = [(path, p.opts[0], choices_of(p)) for path, p in OPTIONS if choices_of(p)]
RANGED = [
    (path, p.opts[0], bound, value)
    for path, p in OPTIONS
    for bound, value in (("min", getattr(p, "min", None)), ("max", getattr(p, "max", None)))
    if value is not None
]


def _ids(cases: list[tuple]) -> list[str]:
    return [" ".join([*c[0], c[1], *(str(x) for x in c[2:] if isinstance(x, str))]) for c in cases]


def _one_line(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert main(argv) == 2
    out = capsys.readouterr()
    assert out.out == ""
    lines = out.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), out.err
    return lines[0]


def test_the_introspection_finds_the_enum_and_ranged_options():
    found = {(" ".join(path), opt) for path, opt, _ in ENUM_OPTIONS}
    assert {
        ("live recover", "--fault-kind"),
        ("simulate training", "--checkpoint-mode"),
        ("simulate sweep", "--kind"),
        ("live bridge", "--request"),
    } <= found
    assert {(" ".join(path), opt, bound) for path, opt, bound, _ in RANGED} >= {
        ("live recover", "--ranks", "min"),
        ("live recover", "--ranks", "max"),
        ("live recover", "--data-timeout", "min"),
    }


@pytest.mark.parametrize(("path", "option", "choices"), ENUM_OPTIONS, ids=_ids(ENUM_OPTIONS))
def test_a_value_outside_an_enum_option_names_the_option_the_value_and_every_choice(capsys, path, option, choices):
    line = _one_line(capsys, [*path, option, "no-such-value"])
    assert line == f"error: {option} 'no-such-value': expected one of {', '.join(choices)}"


@pytest.mark.parametrize(("path", "option", "bound", "value"), RANGED, ids=_ids(RANGED))
def test_a_number_out_of_range_names_the_option_the_value_and_the_range(capsys, path, option, bound, value):
    outside = value - 1 if bound == "min" else value + 1
    line = _one_line(capsys, [*path, f"{option}={outside}"])
    assert line.startswith(f"error: {option} '{outside}': expected ") and str(value) in line
    assert ("at least" in line or "from" in line) if bound == "min" else ("at most" in line or "to" in line)


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["live", "recover", "--ranks", "x"], "error: --ranks 'x': expected an integer from 2 to 16"),
        (["live", "recover", "--ranks"], "error: --ranks: requires an argument; see 'meshpact live recover --help'"),
        (
            ["live", "recover", "--rank", "3"],
            "error: --rank: no such option (did you mean --min-ranks or --ranks or "
            "--spare-ranks?); see 'meshpact live recover --help'",
        ),
        (
            ["simulate", "sweep", "--param", "x=1"],
            "error: --scenario is required; see 'meshpact simulate sweep --help'",
        ),
        (
            ["plan", "--facts", "/no/such/facts.yaml"],
            "error: /no/such/facts.yaml: no such facts file; expected a YAML or JSON edge description",
        ),
        (
            ["simulate", "training", "--scenario", "/no/such/scenario.yaml"],
            "error: /no/such/scenario.yaml: no such scenario file",
        ),
    ],
)
def test_other_refused_command_lines_get_one_line_too(capsys, argv, line):
    assert _one_line(capsys, argv) == line
