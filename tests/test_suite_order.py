"""The suite's file order (tests/conftest.py) names files that exist: a renamed or removed
file would otherwise fall silently to the back of the queue and lengthen ``make test``."""

from __future__ import annotations

from pathlib import Path

from conftest import LONGEST_FIRST

ROOT = Path(__file__).resolve().parents[1]


def test_every_file_in_the_longest_first_order_exists_once():
    missing = [p for p in LONGEST_FIRST if not (ROOT / p).is_file()]
    assert missing == [], f"tests/conftest.py LONGEST_FIRST names files that do not exist: {missing}"
    assert len(set(LONGEST_FIRST)) == len(LONGEST_FIRST)
