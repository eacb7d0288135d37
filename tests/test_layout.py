"""The package's layout: no import cycle anywhere in `jax_specdec/` (function-local
imports included), no module importing another's private name, and the finders of both
find one when there is one."""

import ast
import pathlib

import jax_specdec

PACKAGE = pathlib.Path(jax_specdec.__file__).parent


def _module_name(root: pathlib.Path, file: pathlib.Path) -> str:
    parts = [root.name, *file.relative_to(root).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _package(name: str, file: pathlib.Path) -> str:
    """The package a module's relative imports start from."""
    return name if file.name == "__init__.py" else name.rpartition(".")[0]


def _source(node: ast.ImportFrom, package: str) -> str:
    """The module `from ... import` imports from, relative imports resolved."""
    base = node.module or ""
    if node.level:
        anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join([*anchor, base] if base else anchor)
    return base


def import_graph(root: pathlib.Path) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports, at any depth of its code.
    `from P import name` counts as an import of P.name where that is a module, else of P."""
    files = {_module_name(root, f): f for f in sorted(root.rglob("*.py"))}
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, file in files.items():
        package = _package(name, file)
        for node in ast.walk(ast.parse(file.read_text(), str(file))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _source(node, package)
                targets = [
                    f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names
                ]
            else:
                continue
            graph[name] |= {t for t in targets if t in files and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def private_imports(root: pathlib.Path) -> list[str]:
    """Each `from M import _name` (relative ones too) in a module of `root`'s package where
    M is another module of that package: "module: M._name". Dunder names are not private."""
    files = {_module_name(root, f): f for f in sorted(root.rglob("*.py"))}
    found = []
    for name, file in files.items():
        for node in ast.walk(ast.parse(file.read_text(), str(file))):
            if not isinstance(node, ast.ImportFrom):
                continue
            base = _source(node, _package(name, file))
            if base == name or base.split(".")[0] != root.name:
                continue
            found += [
                f"{name}: {base}.{a.name}"
                for a in node.names
                if a.name.startswith("_") and not a.name.endswith("__")
            ]
    return found


def test_no_import_cycle():
    graph = import_graph(PACKAGE)
    assert len(graph) > 50 and sum(map(len, graph.values())) > 100  # the walk saw the package
    assert cycles(graph) == []


def test_a_cycle_is_found(tmp_path):
    root = tmp_path / "pkg"
    (root / "sub").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "sub" / "__init__.py").write_text("from pkg.sub.a import f\n")
    (root / "sub" / "a.py").write_text("def f():\n    from pkg import b\n")
    (root / "b.py").write_text("from .sub import a\n")
    (root / "c.py").write_text("import pkg.b\n")
    graph = import_graph(root)
    assert graph["pkg.b"] == {"pkg.sub.a"} and graph["pkg.c"] == {"pkg.b"}
    assert cycles(graph) == [["pkg.b", "pkg.sub.a"]]


def test_no_module_imports_a_private_name_of_another():
    assert private_imports(PACKAGE) == []


def test_a_private_import_is_found(tmp_path):
    root = tmp_path / "pkg"
    (root / "sub").mkdir(parents=True)
    (root / "__init__.py").write_text("from pkg.a import __version__, public\n")
    (root / "a.py").write_text("from __future__ import annotations\nfrom os import _exit\n")
    (root / "b.py").write_text("from pkg.a import _hidden, shown\n")
    (root / "sub" / "__init__.py").write_text("")
    (root / "sub" / "c.py").write_text("def f():\n    from ..a import _helper\n")
    (root / "sub" / "d.py").write_text("from . import _near\nfrom .c import f\n")
    assert private_imports(root) == [
        "pkg.b: pkg.a._hidden",
        "pkg.sub.c: pkg.a._helper",
        "pkg.sub.d: pkg.sub._near",
    ]


def test_root_holds_the_core_only():
    modules = sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__")
    assert len(modules) <= 10, modules
