"""Numerics of each dtype in NumPy: storage, rounding and the unit roundoff.

The interpreter computes in the tensor's own dtype, as a device would, without torch.
``float32``, ``float16``, ``int64`` and ``int32`` are native NumPy types. ``bfloat16`` has
no NumPy type: its values are kept in ``float32`` storage and every arithmetic result is
rounded back to the nearest ``bfloat16`` (round to nearest, ties to even, on the upper 16
bits of the float32 pattern, exactly as torch's CPU kernels round a float32 result), so a
sum of ``bfloat16`` addends here carries the same bits as on a device that adds in float32
and stores bfloat16.

:func:`unit_roundoff` is the ``u`` of the error bounds the contract states (``2**-24`` for
float32, ``2**-53`` for float64, ``2**-8`` for bfloat16, ``2**-11`` for float16, ``0`` for integers): one
rounding moves a value by at most ``u`` times its magnitude.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from .facts import DType

__all__ = ["STORAGE", "storage", "round_to", "round_bfloat16", "unit_roundoff", "smallest_subnormal"]

STORAGE: Mapping[DType, type] = {
    DType.FLOAT32: np.float32,
    DType.FLOAT64: np.float64,
    DType.BFLOAT16: np.float32,  # values rounded to bfloat16 after every operation
    DType.FLOAT16: np.float16,
    DType.INT64: np.int64,
    DType.INT32: np.int32,
}

_UNIT = {DType.FLOAT32: 2.0**-24, DType.FLOAT64: 2.0**-53, DType.BFLOAT16: 2.0**-8, DType.FLOAT16: 2.0**-11}
_TINY = {DType.FLOAT32: 2.0**-149, DType.FLOAT64: 5e-324, DType.BFLOAT16: 2.0**-133, DType.FLOAT16: 2.0**-24}


def storage(dtype: DType) -> type:
    """The NumPy type that holds values of ``dtype``."""
    return STORAGE[dtype]


def round_bfloat16(x: np.ndarray) -> np.ndarray:
    """``x`` (any float array) rounded to bfloat16, kept in float32 storage; NaN stays NaN."""
    f = np.ascontiguousarray(x, dtype=np.float32)
    bits = f.view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).astype(np.uint32).view(np.float32)
    return np.where(np.isnan(f), f, rounded).astype(np.float32)


def round_to(x: np.ndarray, dtype: DType) -> np.ndarray:
    """``x`` rounded (or converted) to ``dtype``'s values, in its storage type."""
    if dtype is DType.BFLOAT16:
        return round_bfloat16(x)
    return np.asarray(x).astype(STORAGE[dtype])


def unit_roundoff(dtype: DType) -> float:
    """Half the distance from 1 to the next value of ``dtype``; 0 for integers (exact)."""
    return _UNIT.get(dtype, 0.0)


def smallest_subnormal(dtype: DType) -> float:
    """The spacing of ``dtype``'s values near zero (its smallest positive subnormal); 0 for integers."""
    return _TINY.get(dtype, 0.0)
