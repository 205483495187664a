"""The docs claim only what ran: each claim ties to the test or the result that shows it.

A claim on a page carries ``<!-- shown by: REF; REF -->`` (invisible on the site), each REF a test
(``tests/live/test_x.py::test_name``) or a result (``bench/results/x.json:key.sub``); this file
checks that each one exists, so a renamed test or a dropped result key breaks the page's claim
here rather than leaving it standing. Two kinds of claim must carry one:

- every row of ``docs/launch.md``'s table of what each launcher gives;
- on the pages below, a paragraph (or table row) that speaks of NCCL, CUDA, HCCL or GPUs either
  points at what showed it or says it has not run: nothing here has run on a GPU
  (``docs/gpu.md`` keeps that account).

``docs/extending.md`` says how to add a claim.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MARK = re.compile(r"<!--\s*shown by:\s*(.+?)\s*-->")
HARDWARE = re.compile(r"\b(NCCL|nccl|CUDA|HCCL|GPUs?)\b")
NOT_RUN = re.compile(r"\b(not run|has not run|never run|not been shown|not claimed)\b")
# the pages that describe what a recovery does (docs/security.md speaks of torch's footing, docs/gpu.md is the account)
HARDWARE_PAGES = ("README.md", "docs/recovery.md", "docs/launch.md", "docs/rank-loss.md", "docs/timeouts.md")


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _blocks(text: str) -> list[str]:
    """A page's paragraphs and table rows, code blocks left out."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    out: list[str] = []
    for block in re.split(r"\n\s*\n", text):
        out += [ln for ln in block.split("\n")] if block.lstrip().startswith("|") else [block]
    return out


def missing(ref: str) -> str | None:
    """Why ``ref`` shows nothing (None: it names a test or a result that exists)."""
    if "::" in ref:
        path, name = ref.split("::", 1)
        file = ROOT / path
        if not file.is_file():
            return f"{path}: no such test file"
        names = {n.name for n in ast.walk(ast.parse(file.read_text())) if isinstance(n, ast.FunctionDef)}
        return None if name.split("[")[0] in names else f"{path} defines no {name}"
    path, _, key = ref.partition(":")
    file = ROOT / path
    if not path.startswith("bench/results/") or not file.is_file() or not key:
        return f"{ref}: expected tests/...py::test_name or bench/results/<file>.json:<key>[.<key>...]"
    value = json.loads(file.read_text())
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return f"{path} has no {key}"
        value = value[part]
    return None


def _marks() -> list[tuple[str, str]]:
    """Every reference on every page (the syntax shown in code, as docs/extending.md shows it, is none)."""

    def prose(text: str) -> str:
        return re.sub(r"`[^`\n]*`", "", re.sub(r"```.*?```", "", text, flags=re.S))

    return [
        (page.name, ref.strip())
        for page in _pages()
        for found in MARK.findall(prose(page.read_text()))
        for ref in found.split(";")
    ]


def test_every_claim_points_at_a_test_or_a_result_that_exists():
    marks = _marks()
    assert len(marks) >= 14  # the launch table's rows at least
    assert [f"{page}: {why}" for page, ref in marks if (why := missing(ref))] == []


def test_every_row_of_what_each_launcher_gives_is_shown_by_a_test():
    text = (ROOT / "docs" / "launch.md").read_text()
    table = text.split("## What each launcher gives", 1)[1].split("\n\n", 2)[1]
    rows = [ln for ln in table.split("\n") if ln.startswith("|") and not ln.startswith("|---")][1:]
    assert len(rows) >= 10
    assert [r[:60] for r in rows if not MARK.search(r)] == []


@pytest.mark.parametrize("page", HARDWARE_PAGES)
def test_what_a_page_says_of_gpus_points_at_what_showed_it_or_says_it_has_not_run(page):
    blocks = [b for b in _blocks((ROOT / page).read_text()) if HARDWARE.search(b)]
    assert [b[:120] for b in blocks if not (MARK.search(b) or NOT_RUN.search(b))] == []


def test_a_reference_that_shows_nothing_is_named():
    assert (
        missing("tests/live/test_launch.py::test_no_such_test")
        == "tests/live/test_launch.py defines no test_no_such_test"
    )
    assert missing("bench/results/recovery.json:no_such_key") == "bench/results/recovery.json has no no_such_key"
    assert missing("bench/results/recovery.json:bit_identical") is None
    assert "expected" in (missing("somewhere else") or "")
