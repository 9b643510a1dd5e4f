"""megapatch: numerics fixes for Megatron-core and Transformer Engine, without a fork.

    import megapatch
    megapatch.enable(tp_reduce_dtype="fp32")   # or MEGAPATCH_TP_REDUCE_DTYPE=fp32 in the launcher
    print(megapatch.status())
    megapatch.disable()                        # every original restored
"""

__version__ = "0.1.0"

from .errors import (  # noqa: E402
    CrossRankMismatchError,
    MegapatchError,
    OptionError,
    OptionUnavailableError,
    UnsupportedConfigurationError,
    UpstreamSurfaceError,
)

__all__ = [
    "enable", "disable", "status", "is_enabled", "__version__",
    "MegapatchError", "OptionError", "OptionUnavailableError", "UpstreamSurfaceError",
    "UnsupportedConfigurationError", "CrossRankMismatchError",
]


# The engine (wrapt, importlib.metadata, ...) loads on first use, not at `import megapatch`: the
# startup hook (megapatch._bootstrap) imports this package in every Python process where a
# MEGAPATCH_* variable is set, and must stay cheap until megatron is imported.
_ENGINE_API = ("enable", "disable", "is_enabled", "status")


def __getattr__(name):
    if name in _ENGINE_API:
        from . import engine

        return getattr(engine, name)
    if not name.startswith("__"):  # `megapatch.engine` etc. without importing them first
        import importlib

        try:
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
