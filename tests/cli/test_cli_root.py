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
