"""Number boxes that say in words what is wrong with what was typed.

Streamlit's ``number_input`` answers a value it cannot take (``0.2`` days in a box of whole
days, a value past its bounds) with a red mark and keeps its old value, so a page goes on
drawing figures for a number the box no longer shows. :func:`number_box` is a text box that
reads what was typed with :func:`read_number` and, where it is not a number the box takes,
says why in one line under it (the box's name, what was typed, what is expected) and returns
None, so the page can stop or hold its figures rather than draw them for another value.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["read_number", "number_box"]


def _shown(x: float) -> str:
    return f"{x:,g}" if not float(x).is_integer() else f"{int(x):,}"


def read_number(
    text: str, name: str, lo: float, hi: float, whole: bool = False
) -> tuple[float | int | None, str | None]:
    """``text`` read as a number from ``lo`` to ``hi`` (a whole one where ``whole``): the value and
    None, or None and one line naming the box, what was typed and what it takes."""
    expected = f"a {'whole number' if whole else 'number'} from {_shown(lo)} to {_shown(hi)}"
    raw = (text or "").strip().replace(",", "").replace("_", "")
    if not raw:
        return None, f"**{name}** is empty: type {expected}."
    try:
        value = float(raw)
    except ValueError:
        return None, f"**{name}**: {text.strip()!r} is not a number; expected {expected}."
    if not math.isfinite(value):
        return None, f"**{name}**: {text.strip()!r} is not a finite number; expected {expected}."
    if whole and not value.is_integer():
        return None, f"**{name}**: {_shown(value)} is not a whole number; expected {expected}."
    if value < lo or value > hi:
        side = "less" if value < lo else "more"
        return None, f"**{name}**: {_shown(value)} is {side} than it takes; expected {expected}."
    return (int(value) if whole else value), None


def number_box(
    container: Any,
    label: str,
    lo: float,
    hi: float,
    value: float,
    *,
    key: str,
    whole: bool = False,
    help: str | None = None,
) -> float | int | None:
    """A text box for a number in ``container`` (``st`` or a column); what was typed, read, or None
    with the reason written under the box in words."""
    text = container.text_input(label, value=_shown(value) if whole else f"{value:g}", key=key, help=help)
    number, problem = read_number(text, label, lo, hi, whole)
    if problem:
        container.error(problem)
    return number
