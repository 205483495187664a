"""The suite's file order (tests/conftest.py) names files that exist: a renamed or removed
file would otherwise fall silently to the back of the queue and lengthen ``make test``."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _longest_first() -> tuple[str, ...]:
    spec = importlib.util.spec_from_file_location("suite_conftest", ROOT / "tests" / "conftest.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.suite_order()


def test_every_file_in_the_longest_first_order_exists_once():
    order = _longest_first()
    missing = [p for p in order if not (ROOT / p).is_file()]
    assert missing == [], f"tests/conftest.py LONGEST_FIRST or MOSTLY_WAITING names files that do not exist: {missing}"
    assert len(set(order)) == len(order) > 0
