"""The Python files of one Transformer Engine release, parsed with ``ast`` (never imported): read
from a ``transformer-engine`` py3-none-any wheel or from an installed tree, for the static wiring
check (``megapatch.te_check.wiring``). Each parsed node knows its parent."""

from __future__ import annotations

import ast
import os
import zipfile
from typing import Dict, List, Optional, Sequence, Tuple


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
        copy = Sources(f"{self.label} ({name} edited)", names, lambda n: edited if n == name else self._read(n))
        # a module's tree and calls depend on its own file alone: the unedited ones are shared
        changed = _module_of_path(name)
        copy._parsed = {m: tree for m, tree in self._parsed.items() if m != changed}
        copy._calls = {m: calls for m, calls in self._calls.items() if m != changed}
        return copy

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
