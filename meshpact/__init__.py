"""Meshpact: typed contracts and checked plans for results that cross vendor boundaries,
and in-memory recovery of sharded training from communication faults.

The packages: ``meshpact.core`` (pure Python, no torch), ``meshpact.simulator`` (SimPy),
``meshpact.live`` (torch.distributed), ``meshpact.app`` (Streamlit). The console script
``meshpact`` is :func:`meshpact.cli.run`.
"""

__version__ = "0.1.0"
__all__ = ["__version__"]
