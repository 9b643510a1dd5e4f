"""Static check of the Transformer Engine wiring that megapatch's TE patch relies on.

Reads TE's Python sources with ``ast`` -- never imports TE -- from a ``transformer-engine``
py3-none-any wheel (Python sources only, ~1 MB: ``pip download --no-deps --only-binary=:all:
transformer-engine==X``) or from an installed tree. What is checked comes from the patch module
its callers pass in (``megapatch.patches.tp_reduce_transformer_engine``): its ``PATCHES`` targets
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
"""

from __future__ import annotations

import ast
import logging
import os
import re
import zipfile
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

log = logging.getLogger("megapatch")

PKG = "transformer_engine/pytorch"
TORCH_SUMS = {"all_reduce", "reduce_scatter_tensor", "reduce_scatter", "_reduce_scatter_base",
              "all_reduce_coalesced", "reduce_scatter_tensor_coalesced"}
_NOT_SUM_OPS = ("MAX", "MIN", "BAND", "BOR", "BXOR")
# a cheap text filter before parsing a file: any call that may sum over a process group
_REDUCING_TEXT = re.compile(r"\b(all_reduce\w*|reduce_scatter\w*|_reduce_scatter_base|allreduce|"
                            r"symmetric_all_reduce)\s*\(")


# -- sources -------------------------------------------------------------------------------------

class Sources:
    """The Python files of one TE release: ``read(path)`` and ``files(prefix)`` by archive path."""

    def __init__(self, label: str, names: Sequence[str], read):
        self.label = label
        self._names = sorted(names)
        self._read = read
        self._parsed: Dict[str, Optional[Tuple[ast.Module, bool]]] = {}
        self._calls: Dict[str, List[ast.Call]] = {}
        self._attrs: Dict[Tuple[str, str], set] = {}

    @classmethod
    def wheel(cls, path: str, label: Optional[str] = None) -> "Sources":
        archive = zipfile.ZipFile(path)
        names = [n for n in archive.namelist() if n.startswith("transformer_engine/")]
        return cls(label or os.path.basename(path), names,
                   lambda n: archive.read(n).decode("utf-8"))

    @classmethod
    def tree(cls, root: str, label: Optional[str] = None) -> "Sources":
        names = []
        for folder, _dirs, files in os.walk(os.path.join(root, "transformer_engine")):
            for name in files:
                if name.endswith(".py"):
                    names.append(os.path.relpath(os.path.join(folder, name), root).replace(os.sep, "/"))

        def read(name):
            with open(os.path.join(root, name), encoding="utf-8") as f:
                return f.read()

        return cls(label or root, names, read)

    def with_edit(self, name: str, old: str, new: str, count: int = 1) -> "Sources":
        """A copy with ``old`` replaced by ``new`` in file ``name`` (for testing the check itself)."""
        text = self.read(name)
        if text is None and old == "":
            edited = new  # a new file
        elif text is None or text.count(old) < count:
            raise ValueError(f"{name} does not contain {old!r} {count} time(s)")
        else:
            edited = text.replace(old, new, count)
        names = self._names if name in self._names else self._names + [name]
        return Sources(f"{self.label} ({name} edited)", names,
                       lambda n: edited if n == name else self._read(n))

    def files(self, prefix: str) -> List[str]:
        return [n for n in self._names if n.startswith(prefix) and n.endswith(".py")]

    def read(self, name: str) -> Optional[str]:
        return self._read(name) if name in self._names else None

    def module(self, dotted: str) -> Optional[Tuple[ast.Module, bool]]:
        """``(tree, is_package)`` of a module, or None when the release has no such file."""
        if dotted not in self._parsed:
            base = dotted.replace(".", "/")
            found = None
            for path, package in ((base + ".py", False), (base + "/__init__.py", True)):
                text = self.read(path)
                if text is not None:
                    found = (_with_parents(ast.parse(text)), package)
                    break
            self._parsed[dotted] = found
        return self._parsed[dotted]

    def calls(self, dotted: str) -> List[ast.Call]:
        """Every call in a module (which must exist), in source order."""
        if dotted not in self._calls:
            tree = self.module(dotted)[0]
            found = [n for n in ast.walk(tree) if isinstance(n, ast.Call)]
            self._calls[dotted] = sorted(found, key=lambda n: (n.lineno, n.col_offset))
        return self._calls[dotted]


def _with_parents(tree: ast.Module) -> ast.Module:
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            child._parent = node  # type: ignore[attr-defined]
    return tree


def _parent(node):
    return getattr(node, "_parent", None)


def _module_of_path(path: str) -> str:
    dotted = path[:-3].replace("/", ".")
    return dotted[: -len(".__init__")] if dotted.endswith(".__init__") else dotted


# -- names, definitions, signatures ---------------------------------------------------------------

def _top_level(tree: ast.Module) -> Iterable[ast.stmt]:
    """Module-level statements, including those inside module-level if/try/with blocks."""
    stack = list(reversed(tree.body))
    while stack:
        stmt = stack.pop()
        yield stmt
        if isinstance(stmt, (ast.If, ast.Try, ast.With)):
            inner = list(stmt.body) + list(getattr(stmt, "orelse", []))
            inner += list(getattr(stmt, "finalbody", []))
            for handler in getattr(stmt, "handlers", []):
                inner += handler.body
            stack.extend(reversed(inner))


def _absolute(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    parts = module.split(".")
    if not is_package:
        parts = parts[:-1]
    if node.level > 1:
        parts = parts[: len(parts) - (node.level - 1)]
    return ".".join(parts + ([node.module] if node.module else []))


def resolve(src: Sources, module: str, name: str, depth: int = 0):
    """``(module, node)`` defining ``module.name`` (a def, class or assignment), following
    ``from`` imports and star imports through the release's own files; None if not found."""
    parsed = src.module(module)
    if parsed is None or depth > 8:
        return None
    tree, package = parsed
    found = None
    stars = []
    for stmt in _top_level(tree):
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and stmt.name == name:
            found = (module, stmt)
        elif isinstance(stmt, (ast.Assign, ast.AnnAssign)):
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                found = (module, stmt)
        elif isinstance(stmt, ast.ImportFrom):
            source = _absolute(module, package, stmt)
            for alias in stmt.names:
                if alias.name == "*":
                    stars.append(source)
                elif (alias.asname or alias.name) == name:
                    found = resolve(src, source, alias.name, depth + 1) or ("<unresolved>", stmt)
    if found is not None and found[0] != "<unresolved>":
        return found
    for source in stars:
        hit = resolve(src, source, name, depth + 1)
        if hit is not None:
            return hit
    return found


def _class_member(src: Sources, module: str, cls: ast.ClassDef, name: str, depth: int = 0):
    for stmt in cls.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)) and stmt.name == name:
            return module, cls, stmt
    for base in _bases(src, module, cls):
        hit = _class_member(src, base[0], base[1], name, depth + 1) if depth < 8 else None
        if hit is not None:
            return hit
    return None


def _bases(src: Sources, module: str, cls: ast.ClassDef):
    for base in cls.bases:
        if isinstance(base, ast.Name):
            hit = resolve(src, module, base.id)
            if hit is not None and isinstance(hit[1], ast.ClassDef):
                yield hit


def resolve_attr(src: Sources, module: str, attr: str):
    """``(kind, function node)`` for a Target's ``module``/``attr``, or ``(problem, None)``."""
    first, *rest = attr.split(".")
    hit = resolve(src, module, first)
    if hit is None:
        return f"{module}.{first} does not exist", None
    owner_module, node = hit
    if owner_module == "<unresolved>":
        return (f"{module}.{first} is imported (line {node.lineno}) but not defined where it is "
                f"imported from"), None
    if not rest:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return "function", node
        return "attribute", None
    if len(rest) != 1 or not isinstance(node, ast.ClassDef):
        return f"{module}.{attr}: {first} is not a class", None
    member = _class_member(src, owner_module, node, rest[0])
    if member is None:
        return f"{module}.{attr} does not exist", None
    decorators = {ast.unparse(d) for d in member[2].decorator_list}
    if "staticmethod" in decorators:
        return "staticmethod", member[2]
    if "classmethod" in decorators:
        return "classmethod", member[2]
    return "method", member[2]


def parameter_names(fn) -> Tuple[str, ...]:
    """Parameter names as ``inspect.signature`` lists them."""
    a = fn.args
    names = [x.arg for x in a.posonlyargs + a.args]
    if a.vararg:
        names.append(a.vararg.arg)
    names += [x.arg for x in a.kwonlyargs]
    if a.kwarg:
        names.append(a.kwarg.arg)
    return tuple(names)


def _self_attrs(src: Sources, module: str, cls: ast.ClassDef, depth: int = 0) -> set:
    """Attributes assigned as ``self.<name>`` in ``cls`` and its bases (within the release)."""
    key = (module, cls.name)
    if key in src._attrs:
        return src._attrs[key]
    found = set()
    for node in ast.walk(cls):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            targets = [node.target]
        stack = list(targets)
        while stack:
            t = stack.pop()
            if isinstance(t, (ast.Tuple, ast.List)):
                stack.extend(t.elts)
            elif isinstance(t, ast.Starred):
                stack.append(t.value)
            elif isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                found.add(t.attr)
    if depth < 8:
        for base_module, base in _bases(src, module, cls):
            found |= _self_attrs(src, base_module, base, depth + 1)
    src._attrs[key] = found
    return found


# -- call sites ------------------------------------------------------------------------------------

def _enclosing_function(node):
    node = _parent(node)
    while node is not None and not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        node = _parent(node)
    return node


def _qualname(node) -> str:
    names = []
    while node is not None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.append(node.name)
        node = _parent(node)
    return ".".join(reversed(names)) or "<module>"


def _own_nodes(fn) -> Iterable[ast.AST]:
    """Nodes of ``fn``'s body, not descending into nested functions, classes or lambdas."""
    stack = list(fn.body)
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
                stack.append(child)


def _dotted(expr) -> Optional[str]:
    parts = []
    while isinstance(expr, ast.Attribute):
        parts.append(expr.attr)
        expr = expr.value
    if isinstance(expr, ast.Name):
        parts.append(expr.id)
        return ".".join(reversed(parts))
    return None


def _keyword(call: ast.Call, name: str):
    for k in call.keywords:
        if k.arg == name:
            return k.value
    return None


def _has_starstar(call: ast.Call) -> bool:
    return any(k.arg is None for k in call.keywords)


def _const(node, default=None):
    return node.value if isinstance(node, ast.Constant) else default


def _torch_dist_aliases(tree: ast.Module) -> set:
    aliases = {"torch.distributed"}
    for node in _top_level(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "torch.distributed" and a.asname:
                    aliases.add(a.asname)
        elif isinstance(node, ast.ImportFrom) and node.module == "torch":
            for a in node.names:
                if a.name == "distributed":
                    aliases.add(a.asname or a.name)
    return aliases


def _torch_sums(src: Sources, module: str) -> List[ast.Call]:
    """Direct ``torch.distributed`` sum collectives (not MAX/MIN reductions) in a module."""
    aliases = _torch_dist_aliases(src.module(module)[0])
    found = []
    for node in src.calls(module):
        dotted = _dotted(node.func) or ""
        head, _, attr = dotted.rpartition(".")
        if head in aliases and attr in TORCH_SUMS:
            op = _keyword(node, "op")
            if op is not None and ast.unparse(op).endswith(_NOT_SUM_OPS):
                continue
            found.append(node)
    return found


def _gemm_rejects(call: ast.Call, fn) -> Optional[str]:
    """Why the fprop recogniser (``tp_reduce_te._is_row_fprop``) surely rejects this call at run
    time, or None when it might accept it."""
    if _has_starstar(call):
        q = _qualname(fn).lower() if fn is not None else ""
        return "**kwargs in a backward function" if ("backward" in q or "wgrad" in q) else None
    if _keyword(call, "extra_output") is None:
        return "no extra_output="
    if _const(_keyword(call, "grad"), False) is True:
        return "grad=True"
    if _const(_keyword(call, "accumulate"), False) is True:
        return "accumulate=True"
    layout = _keyword(call, "layout")
    if layout is not None and isinstance(layout, ast.Constant) and layout.value != "TN":
        return f"layout={layout.value!r}"
    return None


def _gemm_accepts(call: ast.Call, positional: int) -> Optional[str]:
    """None when the recogniser can accept this call as written, else what stops it."""
    if _has_starstar(call) or any(isinstance(a, ast.Starred) for a in call.args):
        return "passes *args/**kwargs"
    if len(call.args) > positional:
        return f"passes {len(call.args)} positional arguments (out_dtype must be a keyword)"
    for name in ("extra_output", "out_dtype"):
        if _keyword(call, name) is None:
            return f"does not pass {name}= as a keyword"
    for name in ("gelu", "out", "grad", "accumulate"):
        value = _keyword(call, name)
        if value is not None and not (isinstance(value, ast.Constant) and not value.value):
            return f"passes {name}={ast.unparse(value)}"
    layout = _keyword(call, "layout")
    if layout is not None and _const(layout) != "TN":
        return f"passes layout={ast.unparse(layout)}"
    return None


def _aliases_of(fn, name: str) -> set:
    """``name`` and every name it was copied from by ``a = b`` in ``fn`` (transitively)."""
    copies: Dict[str, set] = {}
    for node in _own_nodes(fn):
        if (isinstance(node, ast.Assign) and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name) and isinstance(node.value, ast.Name)):
            copies.setdefault(node.targets[0].id, set()).add(node.value.id)
    seen, todo = set(), [name]
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo.extend(copies.get(n, ()))
    return seen


def _gemm_producing(fn, names: set) -> List[ast.Call]:
    found = []
    for node in _own_nodes(fn):
        if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
                and isinstance(node.value.func, ast.Name) and node.value.func.id == "general_gemm"
                and len(node.targets) == 1):
            target = node.targets[0]
            first = target.elts[0] if isinstance(target, ast.Tuple) and target.elts else None
            if isinstance(first, ast.Name) and first.id in names:
                found.append(node.value)
    return found


def _check_layer_module(src: Sources, spec, module: str, gemm_positional: int) -> List[str]:
    parsed = src.module(module)
    if parsed is None:
        return [f"{module}: no such module"]
    tree, _package = parsed
    file = module.replace(".", "/") + ".py"
    helpers = set(spec.REDUCE_PARAMS)
    wrapped = helpers | {"general_gemm"}
    problems: List[str] = []

    def where(node):
        return f"{file}:{node.lineno} ({_qualname(node)})"

    # the wrapped names are module globals bound once, and never reached around
    bound = {}
    for stmt in _top_level(tree):
        if isinstance(stmt, ast.ImportFrom):
            for a in stmt.names:
                bound.setdefault(a.asname or a.name, []).append(stmt)
        elif isinstance(stmt, (ast.FunctionDef, ast.ClassDef, ast.Assign)):
            names = [stmt.name] if not isinstance(stmt, ast.Assign) else [
                t.id for t in stmt.targets if isinstance(t, ast.Name)]
            for n in names:
                bound.setdefault(n, []).append(stmt)
    for name in sorted(wrapped):
        if len(bound.get(name, ())) != 1:
            problems.append(f"{file}: {name} is bound {len(bound.get(name, ()))} times at module level "
                            f"(expected one import)")
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id in wrapped and isinstance(node.ctx, ast.Store) \
                and _enclosing_function(node) is not None:
            problems.append(f"{where(node)}: rebinds {node.id} locally")
        elif isinstance(node, ast.ImportFrom) and any((a.asname or a.name) in wrapped for a in node.names) \
                and _enclosing_function(node) is not None:
            problems.append(f"{where(node)}: imports a wrapped helper locally")
    for node in src.calls(module):
        if isinstance(node.func, ast.Attribute) and node.func.attr in wrapped:
            problems.append(f"{where(node)}: calls {ast.unparse(node.func)}(...) around the module "
                            f"global megapatch wraps")
    for call in _torch_sums(src, module):
        problems.append(f"{where(call)}: calls {ast.unparse(call.func)} directly (a reduction "
                        f"megapatch cannot reach)")

    fprop_gemms = set()
    for node in src.calls(module):
        if not (isinstance(node.func, ast.Name) and node.func.id in helpers):
            continue
        name, handled = node.func.id, spec.REDUCE_PARAMS[node.func.id]
        fn = _enclosing_function(node)
        stmt = _parent(node)
        shape_ok = (isinstance(stmt, ast.Assign) and stmt.value is node and len(stmt.targets) == 1
                    and isinstance(stmt.targets[0], ast.Tuple) and len(stmt.targets[0].elts) == 2
                    and all(isinstance(e, ast.Name) for e in stmt.targets[0].elts))
        if not shape_ok:
            problems.append(f"{where(node)}: {name}(...) result is not unpacked as `tensor, handle = ...`")
            continue
        if len(node.args) > len(handled) or any(isinstance(a, ast.Starred) for a in node.args) \
                or _has_starstar(node) or any(k.arg not in handled for k in node.keywords):
            problems.append(f"{where(node)}: {name} called with arguments the wrapper does not "
                            f"understand: {ast.unparse(node)}")
            continue
        async_node = node.args[2] if len(node.args) > 2 else _keyword(node, "async_op")
        async_op = _const(async_node, False) if async_node is not None else False
        if async_node is not None and not isinstance(async_node, ast.Constant):
            problems.append(f"{where(node)}: {name} async_op={ast.unparse(async_node)} is not a constant")
            continue
        handle = stmt.targets[0].elts[1].id
        if async_op:
            if name == "symmetric_all_reduce":
                problems.append(f"{where(node)}: symmetric_all_reduce called with async_op=True")
            waited = any(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                         and n.func.attr == "wait" and _dotted(n.func.value) == handle
                         for n in _own_nodes(fn)) if fn is not None and handle != "_" else False
            if not waited:
                problems.append(f"{where(node)}: async {name} handle {handle!r} is not .wait()-ed in "
                                f"the same function")
            continue
        # synchronous: the row-parallel forward reduction of a general_gemm output
        first = node.args[0] if node.args else _keyword(node, "inp")
        if not isinstance(first, ast.Name) or fn is None:
            problems.append(f"{where(node)}: synchronous {name} does not reduce a local name")
            continue
        gemms = _gemm_producing(fn, _aliases_of(fn, first.id))
        if len(gemms) != 1:
            problems.append(f"{where(node)}: synchronous {name}({first.id}) is fed by {len(gemms)} "
                            f"general_gemm calls in {_qualname(fn)} (expected exactly one)")
            continue
        why = _gemm_accepts(gemms[0], gemm_positional)
        if why:
            problems.append(f"{where(gemms[0])}: the fprop GEMM reduced by {name} {why}: the FP32 "
                            f"accumulator recogniser would not see it")
        fprop_gemms.add(gemms[0])
    if not fprop_gemms:
        problems.append(f"{file}: no row-parallel forward reduction of a general_gemm output found")
    for node in src.calls(module):
        if isinstance(node.func, ast.Name) and node.func.id == "general_gemm" and node not in fprop_gemms:
            if _gemm_rejects(node, _enclosing_function(node)) is None:
                problems.append(f"{where(node)}: this general_gemm call (not a reduced fprop GEMM) "
                                f"could be taken for one by the FP32 accumulator recogniser")
    return problems


# -- the whole check -------------------------------------------------------------------------------

def check(src: Sources, spec) -> List[str]:
    """Problems of the release in ``src`` for the TE patch module ``spec`` (the module
    ``megapatch.patches.tp_reduce_transformer_engine``, passed in by its callers: the checker never
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
