"""elasticd: a fault-tolerant elastic training daemon for PyTorch.

The package has two sides. The daemon side (``elasticd.daemon``, ``elasticd.coordination``,
``elasticd.cluster``, ``elasticd.cli``) never imports torch, so that the per-node daemon stays
small and starts fast. The worker side (the checkpoint client, the torchrun rendezvous plugin)
runs inside torchrun's agent and worker processes, where torch is already loaded.
"""

__version__ = "0.1.0"
