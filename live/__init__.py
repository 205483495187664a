"""meshpact.live: the torch.distributed runtime built on meshpact.core, in three rooms.

- :mod:`meshpact.live.recovery` — in-memory recovery of sharded training from faults;
- :mod:`meshpact.live.plans` — checked plans run across two native domains, metered;
- :mod:`meshpact.live.spillover` — serving across the vendor boundary over a shaped link.

Shared by all three: :mod:`~meshpact.live.launcher` (local ranks with a torchrun-compatible
environment; :mod:`~meshpact.live.forkserver` starts them warm), :mod:`~meshpact.live.store` (stores that listen where they are told),
:mod:`~meshpact.live.backends` (capability detection), :mod:`~meshpact.live.netns` (two
hosts on one machine).
"""
