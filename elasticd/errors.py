"""The root of every error elasticd raises; each family keeps its own root and standard base
(``ValueError``, ``OSError``, ...), so every ``except`` still matches. Standard library only."""


class ElasticdError(Exception):
    """Base class of elasticd's errors: ``except ElasticdError`` catches any of them."""
