"""``python -m meshpact.launch``: the same as ``meshpact launch`` (torchrun's command line; see
:mod:`meshpact.live.launch.command`)."""

from __future__ import annotations

import sys

if __name__ == "__main__":
    from meshpact.live.launch.command import main

    sys.exit(main())
