"""meshpact.live: the torch.distributed runtime built on meshpact.core."""
