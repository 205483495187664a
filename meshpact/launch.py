"""``python -m meshpact.launch``: the same as ``meshpact launch`` (torchrun's command line; see
:mod:`meshpact.live.launch.command`)."""

from __future__ import annotations


if __name__ == "__main__":
    from meshpact.exiting import run_then_exit
    from meshpact.live.launch.command import main

    run_then_exit(main)
