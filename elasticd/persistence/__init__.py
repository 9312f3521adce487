"""The persistent tier: complete snapshots flushed to a (shared) filesystem.

:mod:`~elasticd.persistence.safetensors_file` writes one rank's snapshot as a standard
safetensors file (readable by ``safetensors.torch.load_file`` without elasticd) and reads it
back; :mod:`~elasticd.persistence.tier` lays steps out on disk (per-rank files and markers, a
manifest written last and created exactly once, keep-N pruning) and
:mod:`~elasticd.persistence.persister` is the daemon's asynchronous flusher. Daemon side: none of
it imports torch, and nothing here is ever pickled or unpickled.
"""
