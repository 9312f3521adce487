"""Supervision of the node's torchrun agent and its workers: progress and hang detection."""
