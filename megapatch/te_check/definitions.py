"""Names, definitions and signatures in a Transformer Engine release's sources, for the static
wiring check (``megapatch.te_check.wiring``): where a module-level name is defined (following
``from`` and star imports), what a target's ``module``/``attr`` is, its parameter names, and the
``self.<name>`` attributes a class and its bases set."""

from __future__ import annotations

import ast
from typing import Iterable, Tuple

from megapatch.te_check.sources import Sources


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
