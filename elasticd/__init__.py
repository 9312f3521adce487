"""elasticd: a fault-tolerant elastic training daemon for PyTorch.

The package has two sides. The daemon side (``elasticd.daemon``, ``elasticd.coordination``,
``elasticd.cluster``, ``elasticd.cli``) never imports torch, so that the per-node daemon stays
small and starts fast. The worker side (the checkpoint client, the torchrun rendezvous plugin)
runs inside torchrun's agent and worker processes, where torch is already loaded.
"""

__version__ = "0.1.0"

# The worker API, imported on first use: ``import elasticd`` must not import torch, because the
# daemon imports elasticd and must stay small (docs/facts.md: torch alone costs ~220 MB and 1.5 s).
_LAZY = {
    "Checkpointer": "elasticd.worker.checkpointer",
    "ElasticdError": "elasticd.errors",
    "RestoreResult": "elasticd.worker.checkpointer",
    "RNGState": "elasticd.worker.rng_state",
    "ElasticSampler": "elasticd.worker.sampler",
    "in_process": "elasticd.worker.in_process",
    "Reformation": "elasticd.worker.in_process",
    "Round": "elasticd.worker.in_process",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'elasticd' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))  # a name used once is in both
