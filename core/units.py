"""Units for people: byte counts written the same way by the CLI, the dashboard and the README.

:func:`human_bytes` writes decimal units with one decimal (``229.4 KB``, ``2.5 GB``) and
plain bytes below a kilobyte (``512 B``), so a figure reads the same in every view.
"""

from __future__ import annotations

__all__ = ["human_bytes"]


def human_bytes(n: float) -> str:
    """``n`` bytes in decimal units: ``512 B``, ``10.2 KB``, ``125.8 MB``, ``1.6 GB``."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= size:
            return f"{n / size:,.1f} {unit}"
    return f"{int(n):,} B"
