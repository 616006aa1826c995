"""An app's own code (`custom/`), read but never imported: what a config may take from it.

A component path whose top module is in `custom/` (`custom/np_trainer.py` for
`np_trainer.Trainer`, or a package folder) is the app's code: it is importable only from there,
so the module must be there and define the name (a class, a function, an imported name).
A path whose top module is not in `custom/` may be a library installed where the app runs,
which the control plane cannot see: it is not checked here. A script a FLARE client API
executor starts (`custom/train.py`) must exist, and must not import `nvflare.client`, which no
fedhive trainer has.

Files are parsed with `ast` (nothing is executed); a file over MAX_SCANNED_BYTES, files past a
job's MAX_SCANNED_TOTAL (a `ScanBudget` shared by its apps), a module with `from x import *`
or a module-level `__getattr__` are taken on trust.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass

from fedhive.jobs.archive import MiB
from fedhive.jobs.files import JobFiles
from fedhive.text import clip

MAX_SCANNED_BYTES = 1 * MiB  # one file
MAX_SCANNED_TOTAL = 16 * MiB  # all the files one job's validation reads
CUSTOM = "custom"


@dataclass
class ScanBudget:
    """The bytes of custom code a job's validation may still read."""

    left: int = MAX_SCANNED_TOTAL


class CustomCode:
    """The `custom/` folder of app `app` in `files`."""

    def __init__(self, files: JobFiles, app: str, budget: ScanBudget | None = None) -> None:
        self._files = files
        self._root = f"{app}/{CUSTOM}"
        self._trees: dict[str, ast.Module | str | None] = {}
        self._budget = budget or ScanBudget()

    def _has_file(self, rel: str) -> bool:
        return self._files.has_file(f"{self._root}/{rel}")

    def _has_dir(self, rel: str) -> bool:
        return self._files.has_dir(f"{self._root}/{rel}")

    def class_problem(self, path: str) -> str | None:
        """Why `path` (`module.Name`) cannot come from custom/, or None (it can, or its top
        module is not there)."""
        *module, name = path.split(".")
        top = module[0]
        as_module, as_package = self._has_file(f"{top}.py"), self._has_dir(top)
        if not (as_module or as_package):
            return None
        rel = "/".join(module)
        found = next((f for f in (f"{rel}.py", f"{rel}/__init__.py") if self._has_file(f)), None)
        if found is None:
            if as_package and not self._has_file(f"{top}/__init__.py"):
                return None  # a namespace package may go on in a library
            where = f"{CUSTOM}/{top}.py" if as_module and not as_package else f"{CUSTOM}/{top}/"
            return (f"module {clip('.'.join(module), quote=False)} is not in {CUSTOM}/ "
                    f"({where} is, so it is the only {top} the app can import)")
        tree = self._tree(found)
        if not isinstance(tree, ast.Module):
            return tree
        names = _top_level_names(tree)
        if names is None or name in names:
            return None
        return f"{CUSTOM}/{found} defines no {clip(name, quote=False)}"

    def script_problem(self, script: str) -> str | None:
        """Why `custom/<...>` script `script` cannot run, or None."""
        rel = script.removeprefix(f"{CUSTOM}/")
        if not self._has_file(rel):
            return f"script {clip(script, quote=False)} is not in the app's {CUSTOM}/ folder"
        if not rel.endswith(".py"):
            return None
        tree = self._tree(rel)
        if not isinstance(tree, ast.Module):
            return tree
        line = _imports_flare_client(tree)
        if line is None:
            return None
        return (f"{CUSTOM}/{rel} imports nvflare.client (line {line}); a fedhive trainer uses "
                "`from fedhive import client as flare`, the same API")

    def _tree(self, rel: str) -> ast.Module | str | None:
        """The parsed module; a message for a syntax error; None when too large to read."""
        if rel not in self._trees:
            name = f"{self._root}/{rel}"
            size = self._files.size(name)
            if size > min(MAX_SCANNED_BYTES, self._budget.left):
                self._trees[rel] = None
            else:
                self._budget.left -= size
                self._trees[rel] = _parse(self._files.read(name), rel)
        return self._trees[rel]


def _parse(source: bytes, rel: str) -> ast.Module | str | None:
    try:
        return ast.parse(source, filename=rel)
    except (SyntaxError, ValueError) as err:
        line = getattr(err, "lineno", None)
        at = f" at line {line}" if line else ""
        return (f"{CUSTOM}/{rel}: Python syntax error{at}: "
                f"{clip(getattr(err, 'msg', str(err)), quote=False)}")
    except (RecursionError, MemoryError):  # nested past the parser: Python will say so
        return None


def _top_level_names(tree: ast.Module) -> set[str] | None:
    """The names a module defines at its top level (also inside if/try/with blocks); None when
    it may define others (`from x import *`, a module `__getattr__`)."""
    names: set[str] = set()
    for node in _top_level(tree.body):
        if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            if node.name == "__getattr__":
                return None
            names.add(node.name)
        elif isinstance(node, ast.Import):
            names.update(a.asname or a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if any(a.name == "*" for a in node.names):
                return None
            names.update(a.asname or a.name for a in node.names)
        elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
    return names


def _top_level(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    for node in body:
        yield node
        if isinstance(node, ast.If | ast.For | ast.While | ast.With):
            yield from _top_level(node.body)
            yield from _top_level(getattr(node, "orelse", []))
        elif isinstance(node, ast.Try):
            yield from _top_level(node.body)
            for handler in node.handlers:
                yield from _top_level(handler.body)
            yield from _top_level(node.orelse)
            yield from _top_level(node.finalbody)


def _imports_flare_client(tree: ast.Module) -> int | None:
    """The line of the first import of `nvflare.client` (in any form), or None."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            if any(a.name == "nvflare.client" or a.name.startswith("nvflare.client.")
                   for a in node.names):
                return node.lineno
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "nvflare.client" or node.module.startswith("nvflare.client."):
                return node.lineno
            if node.module == "nvflare" and any(a.name == "client" for a in node.names):
                return node.lineno
    return None
