"""The JSON form of a record: what crosses a process, a file or the CLI's ``--json``.

Records travel between modules as frozen dataclasses. Where one must leave the process —
a launcher's arguments and results, the control channel's values, a recording line, a
``--json`` document — it is written as a :data:`JsonObject` by its own ``to_dict`` and read
back by its own ``from_dict``. The alias says what such a dict may hold (JSON's values,
nested), where ``dict[str, Any]`` would say nothing; nothing else passes one between
modules.
"""

from __future__ import annotations

from typing import Any, Dict

__all__ = ["JsonValue", "JsonObject"]

JsonValue = Any
"""A value JSON can hold: null, a boolean, a number, a string, a list or an object of them.

To the type checker it is ``Any``, as :func:`json.loads` returns: what arrives from a wire or a
file has no static type until its record's ``from_dict`` converts it field by field (``int()``,
``str()``, ``tuple()``), which is where it is checked. A recursive union would make every such
read a cast, and reject a ``list[list[int]]`` written into a record (lists are invariant)."""

JsonObject = Dict[str, JsonValue]
"""A JSON object: the wire form of one record."""
