"""``meshpact control-plane``: a job's rendezvous store and control channel on a host that trains nothing."""

from __future__ import annotations

import typer

__all__ = ["register", "control_plane"]


def control_plane(
    rdzv_id: str = typer.Option(..., "--rdzv-id", help="The job's rendezvous id (the nodes' --rdzv-id)."),
    host: str = typer.Option("127.0.0.1", "--host", help="The address the stores listen on, that alone."),
    port: int = typer.Option(
        29400,
        "--port",
        min=1,
        max=65535,
        help="The rendezvous store's port: the nodes "
        "run `meshpact launch --control-plane service --rdzv-endpoint HOST:PORT`.",
    ),
    control_port: int = typer.Option(
        0,
        "--control-port",
        min=0,
        max=65535,
        help="The control channel's port (0: the kernel picks; the nodes read it from the rendezvous store).",
    ),
    node_loss_s: float = typer.Option(
        5.0,
        "--node-loss-s",
        help="A node whose agent has not beaten on the control "
        "channel for this long is lost: a spare node takes it, or its ranks are "
        "announced gone.",
    ),
    linger_s: float = typer.Option(
        30.0, "--linger-s", help="Seconds the stores stay up once the job ended (the agents' exit still reaches them)."
    ),
) -> None:
    """Serve a job's rendezvous store and control channel apart from its training nodes, until the job ends."""
    from meshpact.live.launch.controlplane import ControlPlaneOptions, run

    options = ControlPlaneOptions(
        rdzv_id=rdzv_id, host=host, port=port, control_port=control_port, node_loss_s=node_loss_s, linger_s=linger_s
    )
    raise typer.Exit(run(options))


def register(groups) -> None:
    groups.root.command("control-plane")(control_plane)
