"""torch's private fields that recovery reads or writes, in one table, with the releases checked.

Rebinding (``rebind.py``), the step reset (``stepreset.py``), the state (``state.py``), the
runtime and the communicators (``communicator.py``) reach into torch where no public API says
what they need: c10d's world and name registry, a ``DeviceMesh``'s group names, FSDP2's
per-module state and parameter groups, a ``DTensor``'s local tensor. None of it is promised by
torch, so :data:`PRIVATE_FIELDS` lists every such field with who uses it, and :func:`check`
says which of them the installed torch lacks: ``tests/live/test_torchprivate.py`` fails
loudly on a torch that removed or renamed one, where recovery would otherwise miss a reference
silently. :data:`CHECKED_ON` names the releases the recovery suite ran on with this table.

An instance attribute (set in ``__init__``, absent from the class) is looked for in the source
of the class and its bases (``self.<name>`` assigned or annotated); a field of a backend the
build lacks (NCCL on a CPU build) cannot be checked there and says so.
"""

from __future__ import annotations

import importlib
import inspect
import re
from dataclasses import dataclass
from enum import Enum
from typing import Any

__all__ = ["PrivateField", "Presence", "PRIVATE_FIELDS", "CHECKED_ON", "presence", "check"]

CHECKED_ON = ("2.13.0",)  # torch releases the recovery suite passed on (CPU build, gloo)


@dataclass(frozen=True)
class PrivateField:
    """``owner.name``: ``owner`` a module or a class (dotted path from ``torch``), ``name`` the
    field; ``used_by`` the Meshpact module(s) that read or write it; ``backend`` the c10d backend
    a build must have for the owner to exist ("" for every build)."""

    owner: str
    name: str
    used_by: str
    backend: str = ""

    def __str__(self) -> str:
        return f"{self.owner}.{self.name}"


class Presence(str, Enum):
    PRESENT = "present"
    MISSING = "missing"
    UNCHECKABLE = "uncheckable"  # the owner needs a backend this build lacks


_C10D = "torch.distributed.distributed_c10d"
_FSDP = "torch.distributed.fsdp._fully_shard"

PRIVATE_FIELDS: tuple[PrivateField, ...] = (
    # c10d's process-group world and its C++ name registry: rebinding moves them to the new groups
    PrivateField(_C10D, "_world", "rebind, runtime, communicator"),
    *(
        PrivateField(f"{_C10D}._World", name, "rebind, communicator, runtime")
        for name in (
            "default_pg",
            "pg_map",
            "pg_names",
            "pg_group_ranks",
            "pg_backend_config",
            "pg_to_tag",
            "tags_to_pg",
            "pg_coalesce_state",
        )
    ),
    PrivateField(_C10D, "_register_process_group", "rebind"),
    PrivateField(_C10D, "_resolve_process_group", "rebind"),
    PrivateField(_C10D, "_unregister_process_group", "rebind"),
    PrivateField(_C10D, "_register_pg_in_world", "communicator"),
    # building a data-path group by hand (backend, name, timeout)
    *(
        PrivateField("torch.distributed.ProcessGroup", name, "communicator")
        for name in ("_set_default_backend", "_register_backend", "_get_backend", "_set_group_name", "_set_group_desc")
    ),
    *(
        PrivateField("torch.distributed.ProcessGroupGloo", name, "communicator")
        for name in ("_set_default_timeout", "_set_sequence_number_for_group", "_get_sequence_number_for_group")
    ),
    PrivateField("torch.distributed.ProcessGroupNCCL.Options", "_timeout", "communicator", backend="nccl"),
    # a DeviceMesh resolves its groups by name on every get_group
    *(
        PrivateField("torch.distributed.device_mesh.DeviceMesh", name, "rebind")
        for name in ("_dim_group_names", "_pg_registry", "_root_mesh", "_flatten_mapping")
    ),
    # FSDP2's state: the modules' states, their parameter groups and collectives, reset between steps
    PrivateField("torch.distributed._composable_state", "_get_module_state", "rebind"),
    PrivateField("torch.distributed._composable_state", "_module_state_mapping", "rebind"),
    *(
        PrivateField(f"{_FSDP}._fsdp_state.FSDPState", name, "rebind, stepreset")
        for name in (
            "_fsdp_param_groups",
            "_is_root",
            "_state_ctx",
            "_comm_ctx",
            "_training_state",
            "_modules_to_run_forward",
        )
    ),
    *(
        PrivateField(f"{_FSDP}._fsdp_param_group.FSDPParamGroup", name, "rebind, stepreset")
        for name in (
            "_all_gather_comm",
            "_reduce_scatter_comm",
            "_all_gather_result",
            "_post_forward_indices",
            "_post_reduce_event",
            "_reshard_after_forward_event",
            "_sharded_state",
            "_training_state",
        )
    ),
    PrivateField(f"{_FSDP}._fsdp_collectives.ProcessGroupAllocMixin", "_group", "rebind"),
    PrivateField(f"{_FSDP}._fsdp_param.FSDPParam", "_unsharded_param", "stepreset"),
    PrivateField(f"{_FSDP}._fsdp_param.FSDPParam", "_setattr_on_modules", "stepreset"),
    PrivateField(f"{_FSDP}._fsdp_common", "TrainingState", "stepreset"),
    PrivateField(f"{_FSDP}._fsdp_param", "ShardedState", "stepreset"),
    # tensors and modules
    PrivateField("torch.distributed.tensor.DTensor", "_local_tensor", "state, runtime"),
    PrivateField("torch.distributed.tensor._utils", "compute_local_shape_and_global_offset", "state"),
    *(
        PrivateField("torch.nn.Module", name, "state, stepreset")
        for name in ("_parameters", "_buffers", "_non_persistent_buffers_set")
    ),
    # schedules: a scheduler of schedulers, a gradient scaler's per-step record
    PrivateField("torch.optim.lr_scheduler.SequentialLR", "_schedulers", "state"),
    PrivateField("torch.optim.lr_scheduler.ChainedScheduler", "_schedulers", "state"),
    PrivateField("torch.amp.GradScaler", "_per_optimizer_states", "state"),
)


def _resolve(path: str) -> Any:
    """The module or class at dotted ``path`` (the longest importable module, then attributes)."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(path)


def _assigned_in_source(cls: type, name: str) -> bool:
    pattern = re.compile(rf"\bself\.{re.escape(name)}\s*(:|=[^=])")
    for klass in cls.__mro__:
        if name in getattr(klass, "__annotations__", {}):
            return True
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):  # a C++ class: its fields are attributes of the class
            continue
        if pattern.search(source):
            return True
    return False


def presence(field: PrivateField) -> Presence:
    """Whether the installed torch has ``field``."""
    if field.backend:
        import torch.distributed as dist

        if not getattr(dist, f"is_{field.backend}_available", lambda: False)():
            return Presence.UNCHECKABLE
    try:
        owner = _resolve(field.owner)
    except (ImportError, AttributeError):
        return Presence.MISSING
    if hasattr(owner, field.name):
        return Presence.PRESENT
    if isinstance(owner, type) and _assigned_in_source(owner, field.name):
        return Presence.PRESENT
    return Presence.MISSING


def check(fields: tuple[PrivateField, ...] = PRIVATE_FIELDS) -> dict[Presence, list[PrivateField]]:
    """Every field of ``fields`` by its :func:`presence` on the installed torch."""
    out: dict[Presence, list[PrivateField]] = {p: [] for p in Presence}
    for field in fields:
        out[presence(field)].append(field)
    return out
