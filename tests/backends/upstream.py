"""Loading the pinned TensorRT-LLM excerpts of tests/backends/fixtures/trtllm/ for tests.

Functions are taken from the excerpt's AST with their decorators dropped (`torch.compile`
is an optimisation, not behaviour) and compiled in a namespace of what they reference, so
a test runs TensorRT-LLM's own text on CPU tensors.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any, Callable

import torch

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "trtllm"


def excerpt(name: str) -> ast.Module:
    """The parsed excerpt file `name` (e.g. 'eagle3_dynamic_tree_excerpt.py')."""
    return ast.parse((FIXTURES / name).read_text())


def header(name: str) -> dict[str, str]:
    """The excerpt's 'Source', 'Commit' and 'License' header lines."""
    out = {}
    for line in (FIXTURES / name).read_text().splitlines()[:8]:
        for key in ("Source", "Commit", "License"):
            if line.startswith(f"# {key}:"):
                out[key] = line.split(":", 1)[1].strip()
    return out


def find(tree: ast.AST, name: str) -> ast.AST:
    """The function or class definition called `name` anywhere in `tree`."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name == name:
            return node
    raise KeyError(name)


def load_function(file: str, name: str, namespace: dict[str, Any] | None = None) -> Callable:
    """Compile the upstream function `name` of excerpt `file` (decorators dropped)."""
    node = find(excerpt(file), name)
    node.decorator_list = []
    module = ast.Module(body=[node], type_ignores=[])
    scope = {"torch": torch, **(namespace or {})}
    exec(compile(ast.fix_missing_locations(module), f"{FIXTURES / file}:{name}", "exec"), scope)
    return scope[name]


def self_attributes(node: ast.AST) -> set[str]:
    """Names X of every `self.X` read or written inside `node`."""
    return {n.attr for n in ast.walk(node)
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self"}


def class_fields(tree: ast.Module, name: str) -> tuple[set[str], set[str], dict[str, ast.expr]]:
    """(public fields, private attributes, field -> annotation) declared in class `name` of an excerpt."""
    cls = find(tree, name)
    public, private, annotations = set(), set(), {}
    for stmt in cls.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            (private if stmt.target.id.startswith("_") else public).add(stmt.target.id)
            annotations[stmt.target.id] = stmt.annotation
    return public, private, annotations


def field_aliases(tree: ast.Module, name: str) -> set[str]:
    """Names accepted through `validation_alias=AliasChoices(...)` in class `name`."""
    aliases = set()
    for node in ast.walk(find(tree, name)):
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "AliasChoices":
            aliases |= {a.value for a in node.args if isinstance(a, ast.Constant)}
    return aliases
