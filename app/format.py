"""Number formats of the dashboard: one way to write a duration, a point in time and a count.

Every page and figure writes numbers through these, so a value reads the same wherever
it appears: durations with three significant digits below 100 s and whole seconds with
thousands separators above (``8.78 s``, ``1,234 s``); a point in a run as hours,
minutes and seconds since its start (``133:54:27.6``), which stays short for a 30-day
run; counts with thousands separators (``16,384``).
"""

from __future__ import annotations

import math

__all__ = ["duration", "clock", "count"]


def duration(seconds: float) -> str:
    """A duration: ``0.0123 s``, ``8.78 s``, ``1,234 s``."""
    s = float(seconds)
    if not math.isfinite(s):
        return "—"
    if abs(s) >= 100:
        return f"{s:,.0f} s"
    return "0 s" if s == 0 else f"{s:.3g} s"


def clock(seconds: float) -> str:
    """A point in a run, from its start: ``h:mm:ss.s`` (``0:00:03.2``, ``133:54:27.6``)."""
    s = float(seconds)
    if not math.isfinite(s):
        return "—"
    sign, s = ("-" if s < 0 else ""), abs(s)
    tenths = round(s * 10)
    h, rest = divmod(tenths, 36000)
    m, rest = divmod(rest, 600)
    return f"{sign}{h}:{m:02d}:{rest / 10:04.1f}"


def count(n: int | float) -> str:
    """A count with thousands separators: ``16,384``."""
    return f"{int(n):,}"
