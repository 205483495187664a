"""``meshpact live bridge``: the JSON document, and bad input named without starting ranks."""

from __future__ import annotations

import json

import pytest

from meshpact.cli import main
from meshpact.core.recording import read_recording


@pytest.mark.live
@pytest.mark.slow
def test_json_reports_verified_equivalence_and_planned_equal_measured(tmp_path, capsys):
    path = tmp_path / "token.jsonl"
    assert main(["live", "bridge", "--request", "token", "--record", str(path), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert set(doc) == {"request", "preset", "verified", "equivalence", "startups", "payload_bytes", "recording"}
    assert (doc["request"], doc["preset"], doc["verified"], doc["equivalence"]) == ("token", "tiny", True, "bitwise")
    assert doc["startups"]["planned"] == doc["startups"]["measured"] > 0
    assert doc["payload_bytes"]["planned"] == doc["payload_bytes"]["measured"] > 0
    assert read_recording(doc["recording"])[-1].event == "verified"


@pytest.mark.parametrize(
    "argv, word", [(["--request", "argmax"], "--request"), (["--request", "full", "--preset", "huge"], "--preset")]
)
def test_bad_request_or_preset_is_named(argv, word, capsys):
    assert main(["live", "bridge", *argv]) == 2
    assert word in capsys.readouterr().err
