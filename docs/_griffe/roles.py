"""Griffe extension for the API reference: Sphinx roles in docstrings read as code.

The docstrings name other objects the reST way (``:class:`~meshpact.live.recovery.state.CommitMark```,
``:func:`is_comm_fault```, ``:mod:`.pipeline```). The reference renders docstrings as Markdown,
so each role becomes a code span of the name it shows (the last part after ``~``, as Sphinx does).
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|attr|data|obj|exc|const):`(~?)([^`]+)`")


def _show(match: re.Match[str]) -> str:
    tilde, target = match.groups()
    return f"`{target.rsplit('.', 1)[-1] if tilde else target.lstrip('.')}`"


class SphinxRolesAsCode(griffe.Extension):
    """Rewrite every Sphinx role in a docstring as a Markdown code span."""

    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _ROLE.sub(_show, obj.docstring.value)
