"""megapatch: numerics fixes for Megatron-core and Transformer Engine, without a fork.

    import megapatch
    megapatch.enable(tp_reduce_dtype="fp32")   # or MEGAPATCH_TP_REDUCE_DTYPE=fp32 in the launcher
    print(megapatch.status())
    megapatch.disable()                        # every original restored
"""


__all__ = [
    "enable", "disable", "status", "is_enabled", "__version__",
    "MegapatchError", "OptionError", "OptionUnavailableError", "UpstreamSurfaceError",
    "UnsupportedConfigurationError", "CrossRankMismatchError",
]

import os as _os  # noqa: E402

if not _os.path.isdir(_os.path.join(_os.path.dirname(__file__), "patches")):
    from . import _checkout  # a source checkout: patches/ lives beside this package

# The engine (wrapt, importlib.metadata, ...) and even the error classes load on first use, not at
# `import megapatch`: the startup hook (megapatch.core.startup) imports this package in every Python
# process where a MEGAPATCH_* variable is set, and must stay cheap until megatron is imported.
_ENGINE_API = ("enable", "disable", "is_enabled", "status")
_ERRORS = ("MegapatchError", "OptionError", "OptionUnavailableError", "UpstreamSurfaceError",
           "UnsupportedConfigurationError", "CrossRankMismatchError")


def __getattr__(name):
    if name == "__version__":
        from .core.version import __version__

        return __version__
    if name in _ENGINE_API:
        from megapatch.core import engine

        return getattr(engine, name)
    if name in _ERRORS:
        from megapatch.core import errors

        return getattr(errors, name)
    if not name.startswith("__"):  # `megapatch.core.engine` etc. without importing them first
        import importlib

        try:
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
