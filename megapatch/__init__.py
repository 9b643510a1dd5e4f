"""megapatch: numerics fixes for Megatron-core and Transformer Engine, without a fork.

    import megapatch
    megapatch.enable(tp_reduce_dtype="fp32")   # or MEGAPATCH_TP_REDUCE_DTYPE=fp32 in the launcher
    print(megapatch.status())
    megapatch.disable()                        # every original restored
"""

__version__ = "0.1.0"

from .engine import disable, enable, is_enabled, status  # noqa: E402
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
