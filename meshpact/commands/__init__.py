"""CLI commands, one module per concern. Each module exposes ``register(cli)`` where
``cli`` is :class:`meshpact.cli.Groups`; heavy imports (torch, simpy) stay inside the
command functions so that ``meshpact --help`` is instant."""
