"""Output helpers shared by the CLI commands."""

from __future__ import annotations

import json
import sys
from typing import Any, Iterable, Sequence

from rich.console import Console
from rich.table import Table

# Piped or captured output has no terminal width to fit; print tables whole rather than
# squeezing their columns to 80 characters.
console = Console(width=None if sys.stdout.isatty() else 160)
err_console = Console(stderr=True)


def emit_json(obj: Any) -> None:
    """Print one JSON document on stdout (machines read this)."""
    sys.stdout.write(json.dumps(obj, indent=2, sort_keys=False, default=_default) + "\n")


def _default(o: Any) -> Any:
    if hasattr(o, "to_dict"):
        return o.to_dict()
    if hasattr(o, "value"):
        return o.value
    if isinstance(o, (set, frozenset, tuple)):
        return list(o)
    raise TypeError(f"not JSON-serialisable: {type(o).__name__}")


def table(title: str, columns: Sequence[str], rows: Iterable[Sequence[Any]], **kw: Any) -> Table:
    t = Table(title=title, title_justify="left", **kw)
    for c in columns:
        t.add_column(c)
    for r in rows:
        t.add_row(*(str(x) for x in r))
    return t
