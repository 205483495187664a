"""Regions: which elements of a producer tensor a piece of data covers.

A region has one entry per tensor dimension; each entry is a tuple of disjoint,
increasing half-open intervals ``((lo, hi), ...)``. Boxes (one interval per dim) describe
shards; several intervals on the row dimension describe the rows an owner holds. The
contract, the lowerer and the checker all speak in these terms, so the symbolic checker
can tell "rows 0..3 of columns 16..32" from "all rows" without touching numbers.
"""

from __future__ import annotations

from typing import Iterable, Sequence

from .placement import shard_bounds

__all__ = [
    "Intervals",
    "Region",
    "full_region",
    "chunk_region",
    "intervals_from_indices",
    "intervals_size",
    "intervals_indices",
    "region_numel",
    "intersect_intervals",
    "concat_intervals",
    "take_intervals",
    "union_intervals",
    "region_text",
]

Intervals = tuple[tuple[int, int], ...]
Region = tuple[Intervals, ...]


def full_region(shape: Sequence[int]) -> Region:
    return tuple(((0, int(s)),) for s in shape)


def chunk_region(region: Region, dim: int, size: int, parts: int, index: int) -> Region:
    """``region`` narrowed to chunk ``index`` of ``parts`` of a dimension of ``size``."""
    lo, hi = shard_bounds(size, parts, index)
    return region[:dim] + (intersect_intervals(region[dim], lo, hi),) + region[dim + 1 :]


def intervals_from_indices(indices: Iterable[int]) -> Intervals:
    """Coalesce increasing indices into intervals (``[0, 1, 2, 5]`` -> ``((0, 3), (5, 6))``)."""
    out: list[list[int]] = []
    for i in indices:
        if out and out[-1][1] == i:
            out[-1][1] = i + 1
        else:
            out.append([i, i + 1])
    return tuple((a, b) for a, b in out)


def intervals_size(iv: Intervals) -> int:
    if len(iv) == 1:  # the common case: one interval
        return iv[0][1] - iv[0][0]
    return sum(b - a for a, b in iv)


def intervals_indices(iv: Intervals) -> list[int]:
    return [i for a, b in iv for i in range(a, b)]


def region_numel(region: Region) -> int:
    n = 1
    for iv in region:
        n *= intervals_size(iv)
    return n


def intersect_intervals(iv: Intervals, lo: int, hi: int) -> Intervals:
    out = tuple((max(a, lo), min(b, hi)) for a, b in iv if min(b, hi) > max(a, lo))
    return out


def take_intervals(iv: Intervals, lo: int, hi: int) -> Intervals:
    """The elements at local positions ``lo..hi`` of ``iv`` (positions count along the intervals)."""
    out = []
    pos = 0
    for a, b in iv:
        n = b - a
        s, e = max(lo - pos, 0), min(hi - pos, n)
        if e > s:
            out.append((a + s, a + e))
        pos += n
        if pos >= hi:
            break
    return tuple(out)


def concat_intervals(a: Intervals, b: Intervals) -> Intervals | None:
    """``a`` followed by ``b`` along one dimension, or None when ``b`` does not come after ``a``."""
    if not a:
        return b
    if not b:
        return a
    if b[0][0] < a[-1][1]:
        return None
    if b[0][0] == a[-1][1]:
        return a[:-1] + ((a[-1][0], b[0][1]),) + b[1:]
    return a + b


def union_intervals(a: Intervals, b: Intervals) -> tuple[Intervals, bool]:
    """Union of two interval sets and whether they overlapped."""
    items = sorted(a + b)
    out: list[list[int]] = []
    overlap = False
    for lo, hi in items:
        if out and lo < out[-1][1]:
            overlap = True
            out[-1][1] = max(out[-1][1], hi)
        elif out and lo == out[-1][1]:
            out[-1][1] = hi
        else:
            out.append([lo, hi])
    return tuple((x, y) for x, y in out if y > x), overlap


def region_text(region: Region) -> str:
    """``[0:4, 16:32]``; several intervals on a dim read ``0:2|5:6``."""
    parts = []
    for iv in region:
        parts.append("|".join(f"{a}:{b}" for a, b in iv) if iv else "∅")
    return "[" + ", ".join(parts) + "]"
