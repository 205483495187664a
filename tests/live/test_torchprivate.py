"""Every private torch field recovery reads is on the installed torch, and the check can say no.

``live/recovery/torchprivate.py`` lists them; an upgrade that removes or renames one fails here,
by name, instead of leaving a reference to a dead group unrebound.
"""

from __future__ import annotations

import torch

from meshpact.live.recovery.torchprivate import CHECKED_ON, PRIVATE_FIELDS, Presence, PrivateField, check, presence


def test_every_listed_private_field_is_on_the_installed_torch():
    found = check()
    assert not found[Presence.MISSING], f"torch {torch.__version__} lacks {[str(f) for f in found[Presence.MISSING]]}"
    # only a backend this build lacks leaves a field unchecked (NCCL on the CPU build)
    assert all(
        f.backend and not getattr(torch.distributed, f"is_{f.backend}_available")() for f in found[Presence.UNCHECKABLE]
    )
    assert torch.__version__.split("+")[0] in CHECKED_ON
    assert len({str(f) for f in PRIVATE_FIELDS}) == len(PRIVATE_FIELDS)


def test_a_field_torch_does_not_have_is_reported_missing():
    # an instance attribute is looked for in the class's source: a name that is not there is missing
    assert (
        presence(PrivateField("torch.distributed.device_mesh.DeviceMesh", "_dim_group_names", "rebind"))
        is Presence.PRESENT
    )
    for field in (
        PrivateField("torch.distributed.device_mesh.DeviceMesh", "_dim_group_name", "-"),
        PrivateField("torch.nn.Module", "_parameter", "-"),
        PrivateField("torch.distributed.fsdp._fully_shard._no_such_module.X", "_y", "-"),
    ):
        assert presence(field) is Presence.MISSING, field
