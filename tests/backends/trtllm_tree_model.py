"""TensorRT-LLM's dynamic-tree build and greedy verify, modelled in Python for CPU tests.

What the worker's `resampling_final_draft_tokens` returns becomes, in TensorRT-LLM, a tree
built by `buildDynamicTreeKernel` and verified by `verifyDynamicTreeGreedyKernel`
(cpp/tensorrt_llm/kernels/speculativeDecoding/dynamicTreeKernels.cu @
84e55f930cbab36e096af441a2e07abdb4199db4). The rules modelled here, as read there:
- node i (tree position i >= 1, history index sel[i-1]) has the root as parent when
  sel[i-1] // topK == 0, else the position of parentList[sel[i-1] // topK] among the
  selected indices (a missing parent is a broken tree: the kernel prints a warning and
  drops the node; here it raises);
- positions are walked from the last to the first and each is pushed at the head of its
  parent's child list, so siblings are in ascending position order;
- the greedy walk starts at the root, tries the children of the last accepted node in
  sibling order and accepts the first whose token equals the target's token at that
  node; it stops at the first node with no match.
A routing model stands in for the MoE target: a node's experts are a fixed function of
its token path from the root, which is what decides its hidden state in every layer.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class BuiltTree:
    parent: tuple[int, ...]  # [N + 1] parent position (-1 for the root at position 0)
    first_child: tuple[int, ...]  # [N + 1] retrieve_next_token (-1 = none)
    next_sibling: tuple[int, ...]  # [N + 1] retrieve_next_sibling (-1 = none)
    tokens: tuple[int, ...]  # [N + 1] candidates: position 0 is the root's token


def build_dynamic_tree(parent_list: list[int], selected: list[int], tokens: list[int], topk: int,
                       root_token: int = -1) -> BuiltTree:
    """The tree TensorRT-LLM builds from one request's parent buffer and selected history indices."""
    n = len(selected) + 1
    parent, first_child, next_sibling = [-1] * n, [-1] * n, [-1] * n
    for i in range(n - 1, 0, -1):
        group = selected[i - 1] // topk
        position = 0
        if group > 0:
            wanted = parent_list[group]
            matches = [p for p, h in enumerate(selected) if h == wanted]
            if not matches:
                raise ValueError(f"position {i} (history {selected[i - 1]}): parent {wanted} is not selected")
            position = matches[0] + 1
        parent[i] = position
        if first_child[position] != -1:
            next_sibling[i] = first_child[position]
        first_child[position] = i
    return BuiltTree(tuple(parent), tuple(first_child), tuple(next_sibling), (root_token, *tokens))


def children(tree: BuiltTree, position: int) -> list[int]:
    out, child = [], tree.first_child[position]
    while child != -1:
        out.append(child)
        child = tree.next_sibling[child]
    return out


def greedy_accept(tree: BuiltTree, target: dict[int, int], max_accept: int) -> list[int]:
    """Accepted positions for target tokens per position (target[p] = the target's argmax at p)."""
    accepted, current = [], 0
    for _ in range(max_accept):
        match = next((c for c in children(tree, current) if tree.tokens[c] == target[current]), None)
        if match is None:
            break
        accepted.append(match)
        current = match
    return accepted


def paths(tree: BuiltTree) -> list[tuple[int, ...]]:
    """Token path from the root (exclusive) to each position; () for the root."""
    out: list[tuple[int, ...]] = [()]
    for i in range(1, len(tree.parent)):
        out.append(out[tree.parent[i]] + (tree.tokens[i],))
    return out


def path_experts(path: tuple[int, ...], num_layers: int = 3, num_experts: int = 64, topk: int = 2
                 ) -> frozenset[tuple[int, int]]:
    """(layer, expert) pairs a token with this root path routes to (a fixed pseudo-random function)."""
    rng = random.Random(repr(path))
    return frozenset((layer, e) for layer in range(num_layers) for e in rng.sample(range(num_experts), topk))
