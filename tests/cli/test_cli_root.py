from __future__ import annotations

import subprocess
import sys


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "meshpact.cli", *args], capture_output=True, text=True)


def test_help_and_version():
    assert "Plan, check and run" in run_cli("--help").stdout
    assert run_cli("--version").stdout.strip().startswith("meshpact ")


def test_unknown_command_is_a_usage_error_not_a_traceback():
    out = run_cli("no-such-command")
    assert out.returncode == 2
    assert "Traceback" not in out.stderr and "No such command" in out.stderr


def _modules_loaded_by(*args: str) -> set[str]:
    code = (
        "import sys\n"
        "from meshpact.cli import main\n"
        f"try:\n    main({list(args)!r})\nexcept SystemExit:\n    pass\n"
        "print('MODULES:', ' '.join(sorted(m for m in sys.modules if m.startswith(('meshpact.commands.', 'torch', 'simpy')))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("MODULES:"))
    return set(line.split()[1:])


def test_help_imports_no_command_module_and_a_command_imports_only_its_own():
    assert not {m for m in _modules_loaded_by("--help") if m != "meshpact.commands._common"}
    assert not _modules_loaded_by("live", "--help")
    loaded = _modules_loaded_by("plan", "--help")
    assert "meshpact.commands.plan" in loaded
    assert not {
        m for m in loaded if m.startswith(("torch", "simpy", "meshpact.commands.simulate", "meshpact.commands.live_"))
    }


def test_each_listed_summary_is_the_help_of_the_command_it_stands_for():
    from meshpact.cli import COMMANDS, build
    import typer.main

    for spec in COMMANDS:
        app = build(list(spec.path))
        group = typer.main.get_command(app)
        cmd = group
        for word in spec.path:
            cmd = cmd.commands[word]
        assert cmd.callback.__module__ == f"meshpact.commands.{spec.module}", spec.path
        assert cmd.help.strip().splitlines()[0] == spec.summary(), spec.path


def test_build_gives_a_fresh_app_each_time():
    from meshpact.cli import build

    assert build(["plan"]) is not build(["plan"])
    first = build(["plan"])
    build(["simulate", "training"])
    assert [c.name for c in first.registered_commands] == ["plan", "edges", "transitions", "launch", "control-plane"]
