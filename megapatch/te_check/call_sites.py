"""Call sites in a Transformer Engine layer module, for the static wiring check
(``megapatch.te_check.wiring``): how each reduce helper is called and its result used, whether an
async handle is waited on, which ``general_gemm`` call feeds a synchronous reduction and whether
the FP32 accumulator recogniser accepts it (and rejects every other one), direct
``torch.distributed`` sums, and wrapped names reached around their module global."""

from __future__ import annotations

import ast
from typing import Dict, Iterable, List, Optional

from megapatch.te_check.definitions import _top_level
from megapatch.te_check.sources import Sources, _parent

TORCH_SUMS = {"all_reduce", "reduce_scatter_tensor", "reduce_scatter", "_reduce_scatter_base",
              "all_reduce_coalesced", "reduce_scatter_tensor_coalesced"}
_NOT_SUM_OPS = ("MAX", "MIN", "BAND", "BOR", "BXOR")


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
