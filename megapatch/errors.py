"""Exceptions megapatch raises. Every message names what was asked, what was found and what to do."""


class MegapatchError(RuntimeError):
    """Base class for every error megapatch raises on purpose."""


class OptionError(MegapatchError, ValueError):
    """An option value (argument or environment variable) that megapatch does not accept."""


class OptionUnavailableError(OptionError):
    """An option that this megapatch build has no patch for yet."""


class UpstreamSurfaceError(MegapatchError):
    """An upstream symbol a patch relies on is missing or has changed shape."""


class UnsupportedConfigurationError(MegapatchError):
    """A model or launcher configuration that a requested patch cannot honour."""


class CrossRankMismatchError(MegapatchError):
    """Ranks of one tensor-parallel group run with different megapatch settings."""
