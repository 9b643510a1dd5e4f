"""megapatch's own version (read by the build backend, the CLI and the cross-rank entries)."""

__version__ = "0.1.0"
