"""The import graph of a package tree, read with `ast` (nothing is imported): which of the
tree's modules each module imports, at module level or inside a function alike, relative
imports resolved. Used by tests/test_layering.py."""
from __future__ import annotations

import ast
from pathlib import Path


def module_name(path: Path, root: Path, alias: dict[str, str]) -> str:
    """Dotted name of the module at `path` (a file under `root`); `alias` maps a top folder to
    the package it installs as (the root `kernels/` folder installs as `dsv4_tree.kernels`)."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    parts[:1] = alias.get(parts[0], parts[0]).split(".")
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _targets(node: ast.AST, name: str, is_package: bool, known: dict) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    if node.level:
        package = name.split(".") if is_package else name.split(".")[:-1]
        base = package[: len(package) - node.level + 1]
        base = ".".join(base + ([node.module] if node.module else []))
    else:
        base = node.module or ""
    # `from a import b` reads b from a.b when b is a submodule, else from a itself
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]


def import_graph(files: dict[str, Path]) -> dict[str, set[str]]:
    """For each module name in `files` (name -> source path), the set of modules of `files` it
    imports. An import of `a.b.c` counts as an import of the nearest enclosing known module."""
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        deps: set[str] = set()
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            for target in _targets(node, name, is_package, files):
                while target and target not in files:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    deps.add(target)
        graph[name] = deps
    return graph


def package_files(root: Path, folders: dict[str, str]) -> dict[str, Path]:
    """name -> path for every .py file under `root`/<folder> for each folder in `folders`
    (folder -> the package it installs as)."""
    files = {}
    for folder in folders:
        for path in sorted((root / folder).rglob("*.py")):
            files[module_name(path, root, folders)] = path
    return files


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (or a module importing
    itself): each is an import cycle. Tarjan's algorithm, iterative."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1 or node in graph.get(node, ()):
                        found.append(sorted(component))
    return found
