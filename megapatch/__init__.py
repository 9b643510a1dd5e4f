"""megapatch: numerics fixes for Megatron-core and Transformer Engine, without a fork.

    import megapatch
    megapatch.enable(tp_reduce_dtype="fp32")   # or MEGAPATCH_TP_REDUCE_DTYPE=fp32 in the launcher
    print(megapatch.status())
    megapatch.disable()                        # every original restored
"""


from .core.errors import (  # noqa: E402
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


class _SourceCheckoutPatches:
    """``sys.meta_path`` entry for a source checkout, where the patch modules live in the top-level
    ``patches/`` folder (the wheel ships that folder as ``megapatch/patches``): finds
    ``megapatch.patches`` there, and nothing else. Consulted only after the regular finders."""

    def __init__(self, folder: str):
        self.folder = folder

    def find_spec(self, fullname, path=None, target=None):
        if fullname != f"{__name__}.patches":
            return None
        from importlib.util import spec_from_file_location

        return spec_from_file_location(fullname, _os.path.join(self.folder, "__init__.py"),
                                       submodule_search_locations=[self.folder])


def _find_source_patches() -> None:
    here = _os.path.dirname(_os.path.abspath(__file__))
    folder = _os.path.join(_os.path.dirname(here), "patches")
    if _os.path.isdir(_os.path.join(here, "patches")) or not _os.path.isfile(_os.path.join(folder, "__init__.py")):
        return  # installed from the wheel, or not a checkout
    if not any(isinstance(f, _SourceCheckoutPatches) for f in _sys.meta_path):
        _sys.meta_path.append(_SourceCheckoutPatches(folder))


import os as _os  # noqa: E402
import sys as _sys  # noqa: E402

_find_source_patches()


# The engine (wrapt, importlib.metadata, ...) loads on first use, not at `import megapatch`: the
# startup hook (megapatch.core.startup) imports this package in every Python process where a
# MEGAPATCH_* variable is set, and must stay cheap until megatron is imported.
_ENGINE_API = ("enable", "disable", "is_enabled", "status")


def __getattr__(name):
    if name == "__version__":
        from .core.version import __version__

        return __version__
    if name in _ENGINE_API:
        from megapatch.core import engine

        return getattr(engine, name)
    if not name.startswith("__"):  # `megapatch.core.engine` etc. without importing them first
        import importlib

        try:
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
