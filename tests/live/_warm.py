"""One fork server per test process, for every live test whose rank starts are not what it
judges: its imports (torch, dynamo and the rank's own modules, 3-4 s of CPU) are paid once
instead of once per launch."""

from __future__ import annotations

import atexit

from meshpact.live.launch.forkserver import ForkServer
from meshpact.live.trials.trial import RANK_PRELOAD

_FORKSERVER: list[ForkServer] = []


def shared_forkserver() -> ForkServer:
    if not _FORKSERVER:
        server = ForkServer(RANK_PRELOAD)
        atexit.register(server.close)
        _FORKSERVER.append(server)
    return _FORKSERVER[0]
