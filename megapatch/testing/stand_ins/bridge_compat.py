"""Importing Megatron-Bridge without Transformer Engine (TE), on CPU: a scoped import stand-in.

Megatron-Bridge 0.6.2 declares TE optional (its ``te`` extra) but one module that ``import
megatron.bridge`` reaches imports it unconditionally: ``megatron/bridge/peft/lora_layers.py``
line 20, ``import transformer_engine.pytorch as te`` (reached through ``models.conversion
.model_bridge`` -> ``peft.canonical_lora``). Everything else in Bridge and all of megatron-core
probe TE with ``try: import transformer_engine`` and run without it. The real TE cannot be used
here: the only ``transformer_engine_torch`` extension on this machine is built for CPython 3.11
(``shared/te-cpu``) and Bridge 0.4+ requires Python 3.12.

:func:`bridge_without_te` (a context manager; :func:`import_bridge` uses it) replaces exactly that
one import, and nothing else:

======================================================  ===========================================
replaced (stand-in)                                     upstream it replaces
======================================================  ===========================================
``transformer_engine`` / ``.pytorch`` / ``.pytorch      ``import transformer_engine.pytorch as te``
.ops`` as *placeholder* modules, visible in             in ``megatron.bridge.peft.lora_layers``,
``sys.modules`` only while that one module's body       module level. The module body reads
runs (its other imports are imported first, without     ``te.ops.Sequential`` in annotations; its
the placeholder); every attribute is a class that       functions test ``isinstance(m, (te.Linear,
matches no object (``isinstance`` is False, as for      te.LayerNormLinear))`` and build ``te.ops``
modules TE never built) and refuses to be               pipelines only for TE-wrapped layers
instantiated, naming this stand-in                      (LoRA on a TE model). TE's real contract
                                                        (``transformer_engine/pytorch/__init__.py``
                                                        2.x): ``Linear``, ``LayerNormLinear`` and
                                                        ``ops.*`` are ``torch.nn.Module`` classes;
                                                        a model built without TE holds none
``nvidia_resiliency_ext`` / ``.inprocess`` the same     ``from nvidia_resiliency_ext.inprocess
way, only while ``megatron.bridge.training.pretrain``   import CallWrapper`` in ``training/pretrain
runs (``CallWrapper``: a placeholder class)             .py`` line 19: an annotation, and the
                                                        in-process-restart path (``cfg.inprocess_
                                                        restart``, off by default). The registry's
                                                        newest nvidia-resiliency-ext (0.4.1) cannot
                                                        be installed beside megatron-core 0.19.2: it
                                                        has no ``__version__`` and megatron-core's
                                                        ``dist_checkpointing`` raises at import (it
                                                        asks for >= 0.6.0)
======================================================  ===========================================

What it guarantees, checked on exit (:func:`check_no_te_seen`): ``transformer_engine`` is not in
``sys.modules``, and no megatron-core or Bridge module holds a true ``HAVE_TE`` flag, so megatron-
core runs exactly as in an environment without TE (its ``get_te_version()`` is 0.0.0). (Bridge's
own ``HAVE_TE*`` flags are not a signal: :func:`check_no_te_seen` says why.) A Bridge
path that needs TE for real (TE layer specs, ``FusedAdam``, Userbuffers, LoRA on TE layers) fails
with the placeholder's error or Bridge's own ImportError; it is never emulated.

Test infrastructure only: the runtime never imports this module.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from typing import Iterator, List, Tuple

__all__ = ["bridge_without_te", "import_bridge", "check_no_te_seen", "NEEDS_TE_AT_IMPORT",
           "STAND_IN_NAMES", "TEStandInError", "TRAINING_WORKAROUNDS"]

#: the Bridge modules whose module-level code imports a missing package unconditionally (Bridge
#: 0.6.2) -> the placeholder modules present only while that module's body executes
SCOPED_STAND_INS = {
    "megatron.bridge.peft.lora_layers": ("transformer_engine", "transformer_engine.pytorch",
                                         "transformer_engine.pytorch.ops"),
    # ``from nvidia_resiliency_ext.inprocess import CallWrapper``: an annotation of _pretrain and the
    # in-process-restart path (cfg.inprocess_restart, off by default). nvidia-resiliency-ext
    # cannot be installed beside megatron-core 0.19.2: the registry's newest (0.4.1) has no
    # __version__ and megatron-core's dist_checkpointing raises AttributeError at import (it
    # wants >= 0.6.0, which the registry does not have)
    "megatron.bridge.training.pretrain": ("nvidia_resiliency_ext", "nvidia_resiliency_ext.inprocess"),
}
NEEDS_TE_AT_IMPORT: Tuple[str, ...] = tuple(SCOPED_STAND_INS)
STAND_IN_NAMES: Tuple[str, ...] = tuple(n for names in SCOPED_STAND_INS.values() for n in names)
_TOPS = tuple(sorted({n.split(".")[0] for n in STAND_IN_NAMES}))
_LABEL = "megapatch.testing.stand_ins.bridge_compat TE import stand-in"


class TEStandInError(RuntimeError):
    """A placeholder TE class was instantiated: this path needs the real Transformer Engine."""


class _Placeholder:
    def __init__(self, *args, **kwargs):
        raise TEStandInError(
            f"{type(self).__module__}.{type(self).__name__}: Transformer Engine is not installed; "
            f"this is the {_LABEL}, which only lets Bridge's module-level import succeed")


def _placeholder_module(name: str) -> types.ModuleType:
    module = types.ModuleType(name, f"{_LABEL} (not Transformer Engine)")
    module.__path__ = []  # a package, so submodules resolve
    module.__megapatch_stand_in__ = True
    classes = {}

    def __getattr__(attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        if attr not in classes:
            classes[attr] = type(attr, (_Placeholder,), {"__module__": name})
        return classes[attr]

    module.__getattr__ = __getattr__
    return module


def _module_imports(name: str, loader) -> List[str]:
    """The absolute module names a module's body imports at top level (not TE)."""
    source = loader.get_source(name)
    names = []
    for node in ast.parse(source).body:
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
    return [n for n in names if n.split(".")[0] not in _TOPS]


class _ScopedLoader(importlib.abc.Loader):
    def __init__(self, spec):
        self._spec = spec
        self._inner = spec.loader

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        for name in _module_imports(self._spec.name, self._inner):  # imported without the placeholder visible
            importlib.import_module(name)
        names = SCOPED_STAND_INS[self._spec.name]
        if any(n in sys.modules for n in names):
            raise RuntimeError(f"{_LABEL}: {names[0]} is already imported; use the real one or none")
        modules = {n: _placeholder_module(n) for n in names}
        for name, placeholder in modules.items():  # each submodule an attribute of its parent
            parent, _, leaf = name.rpartition(".")
            if parent:
                object.__setattr__(modules[parent], leaf, placeholder)
        sys.modules.update(modules)
        try:
            self._inner.exec_module(module)
        finally:
            for n in names:
                sys.modules.pop(n, None)


def _absent(top: str) -> bool:
    return top not in sys.modules and importlib.util.find_spec(top) is None


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname not in SCOPED_STAND_INS or not _absent(SCOPED_STAND_INS[fullname][0]):
            return None  # not one of them, or the real package is installed: Bridge imports it
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None:
            return None
        spec.loader = _ScopedLoader(spec)
        return spec


def check_no_te_seen() -> None:
    """Raises if a TE module (real or placeholder) is imported or any loaded megatron-core module
    recorded TE as available (a true module-level ``HAVE_TE*`` flag).

    Bridge's own ``HAVE_TE*`` flags are not checked: several (``peft.utils``, ``peft.module_matcher``,
    ``models.gemma.modeling_gemma4``) are ``safe_import_from("megatron.core.extensions
    .transformer_engine", "TEColumnParallelLinear")`` and similar, which megatron-core defines
    whether TE is installed or not, so they are true in any environment without TE too."""
    present = [n for n in sys.modules if n.split(".")[0] in _TOPS
               and getattr(sys.modules[n], "__megapatch_stand_in__", False)]
    if present:
        raise RuntimeError(f"{_LABEL}: stand-in packages imported: {sorted(present)[:5]}")
    flags = tuple(flag for top, flag in (("transformer_engine", "HAVE_TE"), ("nvidia_resiliency_ext", "HAVE_NVRX"))
                  if _absent(top))
    flagged = [f"{name}.{attr}" for name, module in list(sys.modules.items())
               if flags and name.startswith("megatron.core") and module is not None
               for attr, value in list(vars(module).items())
               if attr.startswith(flags) and value is True]
    if flagged:
        raise RuntimeError(f"{_LABEL}: megatron-core modules think an absent package is available: "
                           f"{sorted(flagged)[:8]}")


@contextlib.contextmanager
def bridge_without_te() -> Iterator[None]:
    """Inside: importing the modules of :data:`NEEDS_TE_AT_IMPORT` succeeds with the placeholder
    scoped to their bodies. On exit the finder is removed and :func:`check_no_te_seen` runs."""
    finder = _Finder()
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)
    check_no_te_seen()


def import_bridge():
    """``import megatron.bridge`` through :func:`bridge_without_te` (a stand-in only for what is
    not installed); returns the module."""
    with bridge_without_te():
        return importlib.import_module("megatron.bridge")


# --- Bridge's training loop on CPU ranks (megapatch.testing.ranks.cpu_launch --bridge) -----------------

from megapatch.testing.stand_ins.replacements import Workaround  # noqa: E402
from megapatch.testing.stand_ins.megatron_lm_compat import _allow_no_cuda, _one_cuda_device  # noqa: E402

_B_INIT = "megatron.bridge.training.initialize"


def _prebuilt_helpers(original):
    # Bridge's initialize_megatron runs megatron-core's compile_helpers() (``make -C
    # megatron/core/datasets``) on local rank 0 unconditionally; the megatron-core wheel ships the
    # built helpers_cpp extension and no Makefile, so make fails and the job exits. Not CPU-
    # specific: it is what a GPU job on the released wheels meets too. The extension is imported
    # instead; without it, upstream's make runs (and fails as upstream does).
    import functools
    import importlib

    @functools.wraps(original)
    def compile_helpers():
        try:
            importlib.import_module("megatron.core.datasets.helpers_cpp")
        except ImportError:
            return original()
        return None

    return compile_helpers


#: the CUDA-only calls of Bridge's training entry replaced for a CPU run (on top of cpu_compat's
#: megatron-core stand-ins and megatron_lm_compat's torch.cuda ones); each names the upstream call
TRAINING_WORKAROUNDS: Tuple[Workaround, ...] = (
    Workaround(_B_INIT, "initialize_megatron",
               'assert torch.cuda.is_available(), "Megatron requires CUDA." (allow_no_cuda=True)',
               _allow_no_cuda),
    Workaround(_B_INIT, "_initialize_distributed",
               "torch.cuda.device_count() == 0 / torch.cuda.set_device(local_rank)", _one_cuda_device),
    Workaround(_B_INIT, "_set_random_seed",
               "torch.cuda.device_count() == 0 skips model_parallel_cuda_manual_seed", _one_cuda_device),
    Workaround(_B_INIT, "compile_helpers",
               "make -C megatron/core/datasets on local rank 0: the megatron-core wheel has the built "
               "helpers_cpp and no Makefile (fails on GPUs too)", _prebuilt_helpers),
)
