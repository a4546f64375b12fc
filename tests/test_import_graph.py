"""No new import circle inside `trtllm_moespec/` (issue 28): an `ast` walk over the package.

What counts as an edge A -> B (both modules of the package):
- every `import` / `from ... import` in A, relative ones resolved against A's package, at module
  level AND inside functions. A deferred import inside a function does not break at import time,
  but it still means neither module can be read or changed without the other: the circle of issue 28
  (eagle3 <-> eagle3_draft <-> cuda_graphs) ran through exactly such imports.
- NOT the imports under `if TYPE_CHECKING:` (annotations only; they never run).
- `from pkg import name` points at the submodule `pkg.name` when there is one, else at `pkg` itself.
- Importing `a.b.c` does not add edges to `a` and `a.b`, although Python runs their `__init__` first:
  otherwise every submodule of a package whose `__init__` re-exports its submodules would form a
  circle with it, which is the ordinary shape of a package and harmless.
Imports of anything outside the package (torch, transformers, tensorrt) are ignored.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parents[1] / "trtllm_moespec"

# Circles that exist today outside models/ (each a set of modules). Issue 28 asked for no refactor of
# other packages here: these are listed, and any OTHER circle fails the test. An entry that no longer
# exists fails too, so the list only shrinks.
KNOWN_CIRCLES: set[frozenset[str]] = set()


def module_name(path: Path, root: Path, package: str) -> str:
    """The dotted name of the module at `path` inside the package `package` rooted at `root`."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join([package, *parts])


def _type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement of a module, skipping `if TYPE_CHECKING:` bodies (their `else` counts)."""
    found, stack = [], [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        if isinstance(node, ast.If) and _type_checking(node.test):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))
    return found


def _resolve(node: ast.ImportFrom, importer: str, is_package: bool) -> str:
    """The absolute module a `from` import names (relative levels resolved against the importer)."""
    if node.level == 0:
        return node.module or ""
    base = importer.split(".") if is_package else importer.split(".")[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def import_graph(root: Path, package: str | None = None) -> dict[str, set[str]]:
    """module -> the package modules it imports (see the module docstring for what counts)."""
    package = package or root.name
    files = {module_name(p, root, package): p for p in sorted(root.rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        is_package = path.name == "__init__.py"
        targets: set[str] = set()
        for node in _imports(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                candidates = [alias.name for alias in node.names]
            else:
                source = _resolve(node, name, is_package)
                candidates = [f"{source}.{a.name}" if f"{source}.{a.name}" in files else source for a in node.names]
            for target in candidates:
                while target and target not in files and "." in target:  # `import a.b.attr` -> a.b
                    target = target.rsplit(".", 1)[0]
                if target in files and target != name:
                    targets.add(target)
        graph[name] = targets
    return graph


def circles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[frozenset[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(frozenset(component))
    return found


def _describe(circle: frozenset[str], graph: dict[str, set[str]]) -> str:
    edges = sorted(f"{a} -> {b}" for a in circle for b in graph[a] if b in circle)
    return "{" + ", ".join(sorted(circle)) + "}: " + "; ".join(edges)


def test_no_new_import_circle_in_the_package():
    graph = import_graph(PACKAGE_DIR)
    assert "trtllm_moespec.models.target" in graph  # the walk found the package
    found = set(circles(graph))
    new = found - KNOWN_CIRCLES
    assert not new, "new import circle(s):\n" + "\n".join(_describe(c, graph) for c in new)
    gone = KNOWN_CIRCLES - found
    assert not gone, f"known circle(s) no longer exist, remove them from KNOWN_CIRCLES: {gone}"


def test_the_eagle3_package_is_layered_one_way():
    """types <- workspace <- cache <- layers <- modeling <- loading <- static <- graphs <- fused_step <- drafting: no module imports
    a later one, except `Eagle3Drafter.draft_tree`'s deferred import of drafting (the method is the
    drafter's public entry to tree drafting; drafting needs modeling only for annotations). The
    target's verify graphs (`models/cuda_graphs.py`, whose capture machinery graphs.py shares) sit
    below the whole package."""
    graph = import_graph(PACKAGE_DIR)
    assert not {t for t in graph["trtllm_moespec.models.cuda_graphs"] if t.startswith("trtllm_moespec.models.eagle3")}
    layers = ["types", "workspace", "cache", "layers", "modeling", "loading", "static", "graphs", "fused_step", "drafting"]
    prefix = "trtllm_moespec.models.eagle3."
    allowed_upward = {("modeling", "drafting")}
    for i, layer in enumerate(layers):
        for target in graph[prefix + layer]:
            if target.startswith(prefix):
                above = target.removeprefix(prefix)
                assert above in layers, target
                if layers.index(above) > i:
                    assert (layer, above) in allowed_upward, f"{layer} imports {above}, a later layer"


def _write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_the_walker_finds_a_circle_through_relative_and_deferred_imports(tmp_path):
    pkg = _write(tmp_path / "pkg", {
        "__init__.py": "from .a import A\n",
        "a.py": "from .sub.b import B\nA = 1\n",
        "sub/__init__.py": "",
        "sub/b.py": "def f():\n    from ..c import C\n    return C\nB = 2\n",
        "c.py": "import pkg.a\nC = 3\n",
        "d.py": "from . import a\n",  # imports a, nothing imports d: not in the circle
    })
    graph = import_graph(pkg)
    assert graph["pkg"] == {"pkg.a"}
    assert graph["pkg.a"] == {"pkg.sub.b"}
    assert graph["pkg.sub.b"] == {"pkg.c"}  # deferred, two levels up
    assert graph["pkg.c"] == {"pkg.a"}  # absolute
    assert graph["pkg.d"] == {"pkg.a"}  # `from . import module`
    assert circles(graph) == [frozenset({"pkg.a", "pkg.sub.b", "pkg.c"})]


def test_the_walker_ignores_type_checking_imports_and_outside_modules(tmp_path):
    pkg = _write(tmp_path / "pkg", {
        "__init__.py": "",
        "a.py": "import torch\nfrom .b import B\n",
        "b.py": ("from typing import TYPE_CHECKING\nimport typing\nif TYPE_CHECKING:\n    from .a import A\n"
                 "if typing.TYPE_CHECKING:\n    from . import a\nelse:\n    from .c import C\nB = 1\n"),
        "c.py": "from pkg import b\n",  # b -> c (the else branch runs) -> b: a circle
    })
    graph = import_graph(pkg)
    assert graph["pkg.a"] == {"pkg.b"}
    assert graph["pkg.b"] == {"pkg.c"}
    assert circles(graph) == [frozenset({"pkg.b", "pkg.c"})]
    del graph["pkg.c"], graph["pkg.b"]
    assert circles({**graph, "pkg.b": set()}) == []
