"""Patch records as data, and their discovery.

A patch module in ``megapatch.patches`` declares ``PATCHES = (Patch(...), ...)``. The engine finds
them with ``discover()``; it never imports a particular patch by name.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from typing import Callable, Mapping, Optional, Tuple

from megapatch.core.options import Settings


@dataclasses.dataclass(frozen=True)
class Target:
    """One upstream attribute a patch wraps, and what the wrapper relies on.

    ``attr`` is a dotted path inside ``module`` (``"RowParallelLinear.forward"``). ``params`` are
    the leading parameter names the wrapper reads (checked against the installed signature);
    ``kind`` is the kind of attribute found on its owner. ``rebind_aliases`` rebinds
    ``from module import name`` copies held by other loaded modules (module-level functions only;
    never for objects shared with torch, such as a module global bound to a torch collective).
    ``optional`` targets exist only in some upstream versions (another target, or the patch's
    probe, covers the others): when absent they are skipped instead of refusing the patch.
    """

    module: str
    attr: str
    wrapper: Callable
    params: Optional[Tuple[str, ...]] = None
    kind: str = "function"  # function | method | staticmethod | classmethod
    rebind_aliases: bool = True
    optional: bool = False

    @property
    def path(self) -> str:
        return f"{self.module}.{self.attr}"


_PACKAGE_MODULES = {"megatron-core": "megatron", "transformer-engine": "transformer_engine", "torch": "torch"}


@dataclasses.dataclass(frozen=True)
class Patch:
    """One unit of behaviour change, installed and removed as a whole.

    ``hook`` is the module whose import triggers installation: all targets are checked, then all
    are wrapped, so a patch never applies half-way. ``applies`` decides from the settings whether
    it should be installed; ``probe`` (optional) returns ``None`` when the installed upstream can
    take the patch, else the reason it cannot (checked in addition to the targets' surfaces);
    ``backend`` (optional) says which implementation is in use, for status and doctor.
    ``watches`` names further upstream symbols (``"module:Qual.name"``) whose code the patch
    relies on without wrapping them; the patch-surface lock fingerprints them with the targets.
    ``supports`` maps a package to the specifier set (PEP 440) of versions the patch is tested
    on, e.g. ``{"megatron-core": ">=0.13,<0.21"}``: outside it megapatch warns (a version alone
    never refuses; the surface check does); ``megapatch.core.upstream_versions.supported_range`` reads it.
    ``guarantee``: the option's promise needs this patch (``tp_invariant``'s bits): opting out of
    it while the option asks for a change is refused.
    ``preflight`` (optional): given the model a job will build -- an object with megatron-core
    config field names as attributes (plus ``transformer_impl``, ``use_distributed_optimizer`` and
    ``num_distributed_optimizer_instances``),
    as ``megapatch doctor -- <Megatron-LM flags>`` derives it -- the reason this patch would refuse
    it, or ``None``; the patch's own construction-time check must say the same.
    ``notes`` (optional): given the same config as ``preflight``, a line the job logs (once, rank 0)
    when it builds that model, for something accepted that the user should know of
    (``--attention-backend flash`` under ``tp_invariant``), or ``None``; the doctor prints it too.
    ``announces``: the patch only publishes this rank's settings (no upstream behaviour changes);
    it is kept under the kill switch, so that peers learn at once that megapatch is off here.
    ``requires``: names of patches this one builds on (it reads what their wrappers produce): it
    is left out with them (see ``left_out``).
    """

    name: str
    option: Optional[str]
    summary: str
    hook: str
    targets: Tuple[Target, ...]
    applies: Callable[[Settings], bool]
    probe: Optional[Callable[[], Optional[str]]] = None
    backend: Optional[Callable[[], str]] = None
    package: str = "megatron-core"
    watches: Tuple[str, ...] = ()
    supports: Mapping[str, str] = dataclasses.field(default_factory=dict)
    guarantee: bool = False
    preflight: Optional[Callable[[object], Optional[str]]] = None
    notes: Optional[Callable[[object], Optional[str]]] = None
    announces: bool = False
    requires: Tuple[str, ...] = ()

    @property
    def hook_package(self) -> str:
        """The package that holds ``hook`` (``megatron.rl`` for ``megatron.rl.rl_utils``): where it
        cannot be imported (a Megatron-LM checkout's module beside the megatron-core wheel) there is
        nothing to check until a job imports it."""
        return self.hook.rpartition(".")[0] or self.hook

    @property
    def modules(self) -> Tuple[str, ...]:
        """The modules the patch needs imported before it installs: its hook, then those of its
        required targets (a target in a module the hook's import has not yet reached -- megatron-core
        imports ``distributed_data_parallel`` before ``finalize_model_grads`` -- waits for it)."""
        return tuple(dict.fromkeys((self.hook, *(t.module for t in self.targets if not t.optional))))

    @property
    def package_module(self) -> str:
        """The top-level module ``package`` installs (``transformer_engine`` for transformer-engine):
        a patch on megatron-core's TE wrappers has nothing to wrap where TE itself is absent."""
        return _PACKAGE_MODULES.get(self.package, self.hook.split(".")[0])

    def left_out(self, skip_patches) -> Tuple[str, ...]:
        """The opted-out patch names that leave this patch out: its own, or one it builds on."""
        return tuple(name for name in (self.name, *self.requires) if name in skip_patches)


def discover() -> Tuple[Patch, ...]:
    """Every ``Patch`` declared in ``megapatch.patches``: each family package's record modules
    (``<family>/<what>.py``; modules starting with ``_`` hold shared helpers), families and their
    modules in name order."""
    package = importlib.import_module("megapatch.patches")
    found = []
    for family in _public_modules(package):
        if not family.ispkg:
            raise RuntimeError(f"megapatch: {package.__name__}.{family.name} is a module; a patch family is a "
                               f"package, its records in <family>/<what>.py")
        family_package = importlib.import_module(f"{package.__name__}.{family.name}")
        for info in _public_modules(family_package):
            module = importlib.import_module(f"{family_package.__name__}.{info.name}")
            found.extend(getattr(module, "PATCHES", ()))
    names = [p.name for p in found]
    duplicated = {n for n in names if names.count(n) > 1}
    if duplicated:
        raise RuntimeError(f"megapatch: duplicate patch names {sorted(duplicated)}")
    return tuple(found)


def _public_modules(package):
    return [info for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda i: i.name)
            if not info.name.startswith("_")]
