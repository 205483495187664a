"""Run a plan on a person's own values: per consumer rank, what it observes and the reference.

``meshpact plan --facts F --run VALUES`` reads the producer's whole tensor from VALUES (a
``.npy`` file, or a ``.json`` file holding a nested array); for a ``Partial`` producer,
the addends, one per producer rank in rank order (a leading axis in ``.npy``, a list of
arrays in JSON). The values are rounded to the producer's dtype (bfloat16 as torch rounds
it), split over the producer's ranks as its placement says, and the plan is interpreted
(:mod:`meshpact.core.interpreter`). For a log-probability request the target id of each
row is that row's argmax (the greedy token), since a values file holds no ids.

:func:`run_values` returns, for each consumer rank, the observation, the reference and
the verdict under the contract's equivalence; every mistake in the file is one
:class:`~meshpact.core.errors.FactError` naming the file and what was expected.
"""

from __future__ import annotations

import io
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from .contract import Contract
from .errors import FactError, PlanError
from .interpreter import Inputs, equivalent, fold, interpret, magnitudes, reference, region_of
from .numerics import round_to
from .placement import Partial
from .plan import Plan

__all__ = ["RankResult", "RunReport", "load_values", "parse_values", "values_from", "run_values"]

MAX_ELEMENTS = 50_000_000  # a values file larger than this is refused, not read into memory


@dataclass(frozen=True)
class RankResult:
    rank: int
    observed: Any  # nested lists (JSON-able); None when the rank observed nothing
    reference: Any
    ok: bool
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "observed": self.observed,
            "reference": self.reference,
            "verdict": "right" if self.ok else "wrong",
            "reason": self.reason,
        }


@dataclass(frozen=True)
class RunReport:
    ranks: tuple[RankResult, ...]
    error: str | None  # why the plan could not run, if it could not

    @property
    def ok(self) -> bool:
        return self.error is None and all(r.ok for r in self.ranks)

    def to_dict(self) -> dict[str, Any]:
        return {
            "verdict": "right" if self.ok else "wrong",
            "error": self.error,
            "ranks": [r.to_dict() for r in self.ranks],
        }


def _read(path: Path) -> np.ndarray | list[Any]:
    if not path.is_file():
        raise FactError(f"{path}: no such values file; expected a .npy file or a .json array")
    if path.stat().st_size > MAX_ELEMENTS * 8 + 4096:
        raise FactError(f"{path}: larger than {MAX_ELEMENTS:,} values; expected a tensor that fits a test")
    if path.suffix == ".npy":
        with path.open("rb") as fh:
            return _load_npy(fh, path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise FactError(f"{path}: not valid JSON ({exc}); expected a nested array of numbers") from None
    return data


def _load_npy(fh: BinaryIO, name: str | Path) -> np.ndarray:
    """A ``.npy`` array of numbers, its header read first: a file without NumPy's header, an
    array of Python objects (which only unpickling would load; never done) or one larger than
    :data:`MAX_ELEMENTS` is refused in one line before any of its data is read."""
    expected = "expected an array of numbers saved by numpy.save"
    try:
        version = np.lib.format.read_magic(fh)
        if version == (1, 0):
            shape, _, dtype = np.lib.format.read_array_header_1_0(fh)
        elif version == (2, 0):
            shape, _, dtype = np.lib.format.read_array_header_2_0(fh)
        else:
            raise ValueError(f"format version {version[0]}.{version[1]}")
    except (ValueError, OSError, EOFError, SyntaxError):
        raise FactError(f"{name}: not a .npy array (no readable NumPy header); {expected}") from None
    if dtype.hasobject:
        raise FactError(
            f"{name}: holds Python objects ({dtype}), which are never loaded from a values file; {expected}"
        )
    if math.prod(shape) > MAX_ELEMENTS:
        raise FactError(
            f"{name}: {list(shape)} is more than {MAX_ELEMENTS:,} values; expected a tensor that fits a test"
        )
    fh.seek(0)
    try:
        return np.load(fh, allow_pickle=False)
    except (ValueError, OSError, EOFError) as exc:
        raise FactError(f"{name}: not a readable .npy array ({exc}); {expected}") from None


def _array(data: Any, path: Path, what: str, shape: tuple[int, ...]) -> np.ndarray:
    try:
        arr = np.asarray(data, dtype=np.float64 if not isinstance(data, np.ndarray) else None)
    except (ValueError, TypeError):
        raise FactError(f"{path}: {what}: expected a rectangular array of numbers of shape {list(shape)}") from None
    if arr.dtype.kind not in "fiub":
        raise FactError(f"{path}: {what}: expected numbers, got {arr.dtype}")
    if arr.shape != shape:
        raise FactError(f"{path}: {what}: expected shape {list(shape)} (the producer's), got {list(arr.shape)}")
    return arr


def load_values(path: str | Path, contract: Contract) -> Inputs:
    """The producer's values from ``path``, split over its ranks as the contract's placement says."""
    p = Path(path)
    return values_from(_read(p), contract, p)


def parse_values(name: str, content: bytes) -> np.ndarray | list[Any]:
    """Parse an uploaded values file (``.npy`` or JSON) held in memory; ``name`` gives its kind."""
    if len(content) > MAX_ELEMENTS * 8 + 4096:
        raise FactError(f"{name}: larger than {MAX_ELEMENTS:,} values; expected a tensor that fits a test")
    if name.endswith(".npy"):
        return _load_npy(io.BytesIO(content), name)
    try:
        return json.loads(content.decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise FactError(f"{name}: not valid JSON ({exc}); expected a nested array of numbers") from None


def values_from(data: np.ndarray | list[Any], contract: Contract, source: str | Path) -> Inputs:
    """Producer values from parsed ``data`` (named ``source`` in errors), split over the ranks."""
    p = Path(source)
    prov = contract.provenance
    dtype = prov.dtype
    placement = prov.placement
    ranks = prov.ranks
    addends: tuple[np.ndarray, ...] = ()
    if isinstance(placement, Partial):
        n = len(ranks)
        count = len(data) if isinstance(data, (list, np.ndarray)) and np.ndim(data) > 0 else 0
        if count != n:
            raise FactError(
                f"{p}: a {placement!r} producer over {n} ranks needs {n} addends (one per rank), got {count}"
            )
        parts = [_array(data[i], p, f"addend {i}", prov.shape) for i in range(n)]
        addends = tuple(_convert(a, dtype, p) for a in parts)
        value = fold(list(addends), placement.op, dtype)
        local = {r: a for r, a in zip(ranks, addends)}
    else:
        value = _convert(_array(data, p, "values", prov.shape), dtype, p)
        local = {h.rank: region_of(value, h.region).copy() for h in prov.holdings}
    ids = None
    if contract.demand.reads_target_ids:
        ids = np.argmax(value, axis=-1).astype(np.int64)
    return Inputs(value=value, local=local, ids=ids, addends=addends)


def _convert(arr: np.ndarray, dtype: Any, path: Path) -> np.ndarray:
    if not dtype.is_floating:
        if not np.all(np.isfinite(arr)) or not np.array_equal(arr, np.round(arr)):
            raise FactError(f"{path}: the producer is {dtype.value}; expected integers only")
        return arr.astype(np.int64).astype(round_to(np.zeros(1), dtype).dtype)
    return round_to(arr, dtype)


def _listed(x: np.ndarray | None) -> Any:
    if x is None:
        return None
    out = x.astype(np.float64).tolist() if np.issubdtype(x.dtype, np.floating) else x.tolist()
    return _finite(out)


def _finite(v: Any) -> Any:  # JSON has no NaN/inf: write them as strings
    if isinstance(v, list):
        return [_finite(x) for x in v]
    if isinstance(v, float) and not np.isfinite(v):
        return "nan" if np.isnan(v) else ("inf" if v > 0 else "-inf")
    return v


def run_values(plan: Plan, contract: Contract, inputs: Inputs) -> RunReport:
    """Interpret ``plan`` on ``inputs``; per consumer rank, observed, reference and verdict."""
    try:
        ex = interpret(plan, contract, inputs)
    except PlanError as exc:
        return RunReport((), f"cannot execute: {exc}")
    expected = reference(contract, inputs)
    scale = magnitudes(contract, inputs)
    out = []
    for rank, exp in sorted(expected.items()):
        got = ex.observed.get(rank)
        v = equivalent(got, exp, contract, scale[rank])
        out.append(RankResult(rank, _listed(got), _listed(exp), v.ok, v.reason))
    for rank in sorted(set(ex.observed) - set(expected)):
        out.append(RankResult(rank, _listed(ex.observed[rank]), None, False, "observes data but must observe nothing"))
    return RunReport(tuple(out), None)
