"""meshpact.simulator: SimPy models built on meshpact.core."""
