"""Static check of the Transformer Engine wiring that megapatch's TE patch relies on.

Reads TE's Python sources with ``ast`` -- never imports TE -- from a ``transformer-engine``
py3-none-any wheel (Python sources only, ~1 MB: ``pip download --no-deps --only-binary=:all:
transformer-engine==X``) or from an installed tree. What is checked comes from the patch module
its callers pass in (``megapatch.patches.tp_reduce.transformer_engine``): its ``PATCHES`` targets
and its declared wiring
(``LAYERS``, ``REDUCE_PARAMS``, ``GEMM_KEYWORDS``, ``OPS_REDUCING``, ``OPS_FUSED``,
``NOT_WRAPPED``), so the check cannot drift from the patch:

* every target exists in its module (a module-level name may be a ``from`` import, followed to its
  definition), is of the declared kind, and its parameters start with the declared ones; the reduce
  helpers take no parameter the wrappers do not understand; ``general_gemm`` takes every keyword
  the fprop recogniser reads;
* in each layer module: every call of a reduce helper is ``tensor, handle = helper(...)`` with
  parameters the wrapper understands; an ``async_op=True`` call's handle is ``.wait()``-ed in the
  same function; a synchronous call (the row-parallel forward) reduces the first output of a
  ``general_gemm`` call that the recogniser accepts, and every other ``general_gemm`` call in the
  module is one it rejects; nothing reaches the helpers other than through the module global
  (no ``distributed.allreduce(...)``, no local rebinding) and no ``torch.distributed`` sum is
  called directly; the layer classes set the attributes the wrappers read;
* in ``te.ops``: every reducing call sits in an op the fuser wrapper refuses, which set the
  attributes it reads; ``OperationFuser`` keeps ``_basic_ops``;
* no other TE module imports the reduce helpers, except those listed in ``NOT_WRAPPED``.

Used by ``tests/test_tp_reduce_transformer_engine_wiring.py`` and ``tools/te_wiring_check.py`` for every claimed
release (``tools/te_wiring_versions.json``, downloaded by ``tools/te_releases.py``), and, through
``megapatch.te_check.verdict`` (which caches the verdict per TE installation and imports this
module only on a miss), by the patch's probe.

The check is split by concern: the release's files (``sources``), names, definitions and
signatures in them (``definitions``), the call sites of a layer module (``call_sites``); this module
runs the whole check, the ``te.ops`` classes and the coverage of every other TE module.
"""

from __future__ import annotations

import ast
import logging
import re
from typing import List

from megapatch.te_check.call_sites import _check_layer_module, _dotted, _qualname, _torch_sums
from megapatch.te_check.definitions import _absolute, _self_attrs, parameter_names, resolve, resolve_attr
from megapatch.te_check.sources import Sources, _module_of_path

log = logging.getLogger("megapatch")

PKG = "transformer_engine/pytorch"
# a cheap text filter before parsing a file: any call that may sum over a process group
_REDUCING_TEXT = re.compile(r"\b(all_reduce\w*|reduce_scatter\w*|_reduce_scatter_base|allreduce|"
                            r"symmetric_all_reduce)\s*\(")


# -- the whole check -------------------------------------------------------------------------------

def check(src: Sources, spec) -> List[str]:
    """Problems of the release in ``src`` for the TE patch module ``spec`` (the module
    ``megapatch.patches.tp_reduce.transformer_engine``, passed in by its callers: the checker never
    imports a patch); empty when the wiring is as the patch relies on."""
    problems: List[str] = []
    targets = [t for p in spec.PATCHES for t in p.targets if t.module.startswith("transformer_engine.")]
    gemm_positional = 2
    for t in targets:
        kind, fn = resolve_attr(src, t.module, t.attr)
        if fn is None:
            problems.append(kind if kind != "attribute" else f"{t.path} is not a function")
            continue
        if kind != t.kind:
            problems.append(f"{t.path} is a {kind}, expected a {t.kind}")
        params = parameter_names(fn)
        if t.params is not None and params[: len(t.params)] != tuple(t.params):
            problems.append(f"{t.path} takes {params}, expected it to start with {tuple(t.params)}")
        name = t.attr.rpartition(".")[2]
        if name in spec.REDUCE_PARAMS:
            handled = spec.REDUCE_PARAMS[name]
            if params != handled[: len(params)]:
                problems.append(f"{t.path} takes {params}; the wrapper understands {handled}")
        if name == "general_gemm":
            missing = [k for k in spec.GEMM_KEYWORDS if k not in params]
            if missing:
                problems.append(f"{t.path} takes no {missing}")
            if "out_dtype" in params:
                gemm_positional = params.index("out_dtype")
    for layer in spec.LAYERS:
        hit = resolve(src, layer.module, layer.cls)
        if hit is None or not isinstance(hit[1], ast.ClassDef):
            problems.append(f"{layer.module}.{layer.cls}: no such class")
            continue
        attrs = _self_attrs(src, hit[0], hit[1])
        for attr in (layer.parallel_attr, *spec.LAYER_ATTRS, *layer.ub_reducing):
            if attr not in attrs:
                problems.append(f"{layer.module}.{layer.cls} never sets self.{attr}")
        problems += _check_layer_module(src, spec, layer.module, gemm_positional)
    problems += _check_ops(src, spec)
    problems += _check_coverage(src, spec)
    return problems


def _check_ops(src: Sources, spec) -> List[str]:
    problems = []
    fuser = resolve(src, "transformer_engine.pytorch.ops.fuser", "OperationFuser")
    if fuser is None or "_basic_ops" not in _self_attrs(src, *fuser):
        problems.append("transformer_engine.pytorch.ops.fuser.OperationFuser never sets self._basic_ops")
    refused = {}
    for path, attrs in {**spec.OPS_REDUCING, **{p: () for p in spec.OPS_FUSED}}.items():
        module, _, cls = path.rpartition(".")
        hit = resolve(src, module, cls)
        if hit is None or not isinstance(hit[1], ast.ClassDef):
            problems.append(f"{path}: no such class")
            continue
        refused[(module, cls)] = path
        have = _self_attrs(src, *hit)
        problems += [f"{path} never sets self.{a}" for a in attrs if a not in have]
    helpers = set(spec.REDUCE_PARAMS)
    for file in src.files(PKG + "/ops/"):
        if not _REDUCING_TEXT.search(src.read(file)):
            continue
        module = _module_of_path(file)
        calls = list(_torch_sums(src, module))
        calls += [n for n in src.calls(module) if (_dotted(n.func) or "").rpartition(".")[2] in helpers]
        for call in calls:
            owner = _qualname(call).split(".")[0]
            if (module, owner) not in refused:
                problems.append(f"{file}:{call.lineno} ({_qualname(call)}): reduces with "
                                f"{ast.unparse(call.func)} outside the te.ops classes the fuser "
                                f"wrapper refuses")
    return problems


def _check_coverage(src: Sources, spec) -> List[str]:
    helpers = set(spec.REDUCE_PARAMS)
    known = {layer.module for layer in spec.LAYERS} | set(spec.NOT_WRAPPED)
    known.add("transformer_engine.pytorch.distributed")
    problems = []
    for file in src.files(PKG + "/"):
        text = src.read(file)
        if not any(h in text for h in helpers):
            continue
        module = _module_of_path(file)
        if module in known:
            continue
        tree, package = src.module(module)
        for node in ast.walk(tree):
            uses = False
            if isinstance(node, ast.ImportFrom) and _absolute(module, package, node).endswith("distributed"):
                uses = any(a.name in helpers for a in node.names)
            elif isinstance(node, ast.Call) and (_dotted(node.func) or "").rpartition(".")[2] in helpers:
                uses = True
            if uses:
                problems.append(f"{file}:{node.lineno}: uses a TE reduce helper, but the module is "
                                f"neither wrapped nor listed in NOT_WRAPPED")
                break
    return problems
