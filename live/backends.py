"""Capability detection: which process-group backend and device each native domain gets.

A domain asks for its vendor's native runtime (``nccl`` for CUDA, ``hccl`` for Ascend).
Where that runtime is present it is used; where it is not, ``gloo`` on CPU stands in and
the choice says so, with what the real path would need. Nothing here guesses: the
decision comes from ``torch.cuda``, ``torch_npu`` and ``torch.distributed``'s own
availability checks.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from meshpact.core.facts import Backend, Vendor

__all__ = ["BackendChoice", "choose_backend", "cuda_ready", "npu_ready"]


@dataclass(frozen=True)
class BackendChoice:
    vendor: Vendor
    backend: Backend
    device: str  # "cpu", "cuda:<local rank>", "npu:<local rank>"
    stand_in: bool  # True when gloo/CPU stands in for the vendor's runtime
    reason: str

    def to_dict(self) -> dict:
        return {
            "vendor": self.vendor.value,
            "backend": self.backend.value,
            "device": self.device,
            "stand_in": self.stand_in,
            "reason": self.reason,
        }


def cuda_ready() -> bool:
    return torch.cuda.is_available() and dist.is_nccl_available()


def npu_ready() -> bool:
    if importlib.util.find_spec("torch_npu") is None:
        return False
    import torch_npu  # noqa: F401  (registers the 'npu' device and the hccl backend)

    return bool(getattr(torch, "npu", None) and torch.npu.is_available())  # type: ignore[attr-defined]  # torch_npu adds torch.npu


def choose_backend(vendor: Vendor | str, local_rank: int = 0, force_gloo: bool | None = None) -> BackendChoice:
    """Pick the backend and device for a rank of ``vendor``.

    ``force_gloo`` (default: the ``MESHPACT_FORCE_GLOO`` environment variable) keeps every
    domain on gloo/CPU even where a vendor runtime exists, e.g. to compare against it.
    """
    vendor = Vendor(vendor)
    if force_gloo is None:
        force_gloo = os.environ.get("MESHPACT_FORCE_GLOO", "") not in ("", "0")
    if vendor is Vendor.CPU:
        return BackendChoice(vendor, Backend.GLOO, "cpu", False, "CPU domain: gloo is its native backend")
    if force_gloo:
        return BackendChoice(vendor, Backend.GLOO, "cpu", True, "MESHPACT_FORCE_GLOO is set")
    if vendor is Vendor.CUDA:
        if cuda_ready():
            index = local_rank % torch.cuda.device_count()
            return BackendChoice(vendor, Backend.NCCL, f"cuda:{index}", False, "CUDA device and NCCL present")
        return BackendChoice(
            vendor,
            Backend.GLOO,
            "cpu",
            True,
            "no CUDA device or NCCL here; gloo on CPU stands in (needs a CUDA GPU and torch built with NCCL)",
        )
    if npu_ready():
        index = local_rank % torch.npu.device_count()  # type: ignore[attr-defined]  # torch_npu adds torch.npu
        return BackendChoice(vendor, Backend.HCCL, f"npu:{index}", False, "Ascend NPU and torch_npu present")
    return BackendChoice(
        vendor,
        Backend.GLOO,
        "cpu",
        True,
        "no Ascend NPU here; gloo on CPU stands in (needs an Ascend device, CANN and torch_npu)",
    )
