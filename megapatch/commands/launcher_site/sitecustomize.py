"""megapatch's start-up hook for processes launched by ``megapatch-run``.

``megapatch-run`` puts this directory first on ``PYTHONPATH``, so every Python process of the
command imports this file at start (``site`` imports ``sitecustomize``), even where ``.pth`` files
are not read (``pip install --target DIR`` + ``PYTHONPATH=DIR``, zipapps). It arms megapatch's
environment activation (``megapatch.core.startup``: stdlib only until megatron is imported), then
runs the ``sitecustomize`` that would have run without it, further down ``sys.path``.
"""

import os
import sys


TRIGGERS = ("megatron", "transformer_engine")


def _arm() -> None:
    try:
        from megapatch.core import startup
    except ImportError:
        sys.meta_path.insert(0, _Deferred())
        return
    startup.activate_from_environment()


class _Deferred:
    """megapatch is not importable yet at start (a zipapp or a script directory joins sys.path
    only after ``site`` ran): try again when megatron is looked up, and refuse the import if this
    Python still cannot import megapatch, instead of letting it train unpatched."""

    megapatch_trigger = True

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in TRIGGERS or self not in sys.meta_path:
            return None
        sys.meta_path.remove(self)
        try:
            from megapatch.core import startup
        except ImportError as exc:
            sys.meta_path.insert(0, self)
            requested = ", ".join(k for k in sorted(os.environ) if k.startswith("MEGAPATCH_"))
            raise ImportError(
                f"megapatch-run: this Python ({sys.executable}) cannot import megapatch ({exc}), "
                f"so {requested} cannot apply; put the directory megapatch is installed in on "
                f"PYTHONPATH, or run without megapatch-run and those variables") from exc
        startup.arm()
        return None


def _chain() -> None:
    """Import the next ``sitecustomize`` on ``sys.path`` (the user's or the distribution's)."""
    here = os.path.dirname(os.path.abspath(__file__))
    positions = [i for i, p in enumerate(sys.path) if os.path.abspath(p or os.curdir) == here]
    for i in reversed(positions):
        del sys.path[i]
    ours = sys.modules.pop("sitecustomize", None)
    try:
        import sitecustomize  # noqa: F401 -- the next one on sys.path, if any
    except ImportError as exc:
        if exc.name != "sitecustomize":
            raise
        if ours is not None:
            sys.modules["sitecustomize"] = ours
    finally:
        for i in positions:
            sys.path.insert(i, here)


if any(k.startswith("MEGAPATCH_") for k in os.environ):
    _arm()
_chain()
