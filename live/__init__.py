"""meshpact.live: the torch.distributed runtime built on meshpact.core, in five rooms.

- :mod:`meshpact.live.recovery` — in-memory recovery of sharded training from faults;
- :mod:`meshpact.live.launch` — ``meshpact launch``'s agent, warm spares, spare nodes, the fork
  server and the local launcher: a job's ranks started, a failed one replaced alone;
- :mod:`meshpact.live.trials` — the trial bench that drives the recovery library from outside;
- :mod:`meshpact.live.plans` — checked plans run across two native domains, metered;
- :mod:`meshpact.live.spillover` — serving across the vendor boundary over a shaped link.

Shared one-file helpers: :mod:`~meshpact.live.store` (stores that listen where they are told),
:mod:`~meshpact.live.backends` (capability detection), :mod:`~meshpact.live.netns` (two hosts on
one machine), :mod:`~meshpact.live._lazy` (the rooms' lazy exports).
"""
