"""The engine: options (one table) -> settings -> patch records -> wrappers installed and removed.

Knows no particular patch: it discovers the records in ``megapatch.patches``. Imports nothing
from ``megapatch.numerics``, ``megapatch.patches``, ``megapatch.commands`` or ``megapatch.testing``.
"""
