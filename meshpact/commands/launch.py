"""``meshpact launch``: torchrun's command line; a failed worker is replaced alone, in place."""

from __future__ import annotations

import typer

__all__ = ["register", "launch"]


def launch(ctx: typer.Context) -> None:
    """Start this node's workers with torchrun's command line; a failed one is replaced alone, in place."""
    from meshpact.live.launch.command import main

    raise typer.Exit(main(list(ctx.args)))


def register(groups) -> None:
    # every argument is torchrun's parser's (help included): nothing is parsed here
    groups.root.command(
        "launch", add_help_option=False, context_settings={"allow_extra_args": True, "ignore_unknown_options": True}
    )(launch)
