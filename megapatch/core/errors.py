"""Exceptions megapatch raises. Every message names what was asked, what was found and what to do."""


class MegapatchError(RuntimeError):
    """Base class for every error megapatch raises on purpose."""


class OptionError(MegapatchError, ValueError):
    """An option value (argument or environment variable) that megapatch does not accept."""


class OptionUnavailableError(OptionError):
    """An option that this megapatch build has no patch for yet."""


class UpstreamSurfaceError(MegapatchError):
    """An upstream symbol a patch relies on is missing or has changed shape.

    The message says what was expected and found; this class appends the installed versions (no
    caller formats them), then ``hint``, what the user can do."""

    _INSTALLED = ". Installed: "

    def __init__(self, message: str, hint: str = ""):
        if self._INSTALLED not in message:  # (an unpickled error arrives with its full message)
            from megapatch.core.upstream_versions import describe_versions

            message = f"{message.rstrip('.')}{self._INSTALLED}{describe_versions()}"
            message += f". {hint}" if hint else ""
        super().__init__(message)


class UnsupportedConfigurationError(MegapatchError):
    """A model or launcher configuration that a requested patch cannot honour."""


class CrossRankMismatchError(MegapatchError):
    """Ranks of one tensor-parallel group run with different megapatch settings."""
