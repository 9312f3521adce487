"""The in-RAM checkpoint engine.

:mod:`~elasticd.checkpoint.format` defines the snapshot format (a checksummed JSON header plus raw,
aligned tensor bytes) and :mod:`~elasticd.checkpoint.shm` the daemon-owned shared-memory slots that
hold snapshots; both are daemon side and never import torch. :mod:`~elasticd.checkpoint.state`
is worker side: it flattens a training state (model, optimizer, scheduler, sampler, RNG, extras)
into named tensors plus JSON meta and copies them into a snapshot buffer. This ``__init__`` imports
nothing, so that importing the daemon-side modules never pulls in torch.
"""
