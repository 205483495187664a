"""Lazy package faces: a room's public names, imported only when first used.

Each room of ``live/`` re-exports its public names from its ``__init__``, but importing a
room must not import torch for a caller that only wants a torch-free piece (the CLI's
``--help``, the dashboard's fault-kind list). :func:`lazy_face` returns the module-level
``__getattr__`` and ``__dir__`` (PEP 562) that import the defining module on first access.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Mapping

__all__ = ["lazy_face"]


def lazy_face(package: str, exports: Mapping[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``exports`` maps a public name to the submodule (relative to ``package``) that defines it."""

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{module}"), name)

    def __dir__() -> list[str]:
        return sorted(exports)

    return __getattr__, __dir__
