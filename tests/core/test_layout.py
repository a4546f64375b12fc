"""Verification layout: paths, ancestor masks, sliding windows and closure checks."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings

from trtllm_moespec.core import build_layout, score_order, top_k_nodes

from .strategies import random_tree, seeds


def _ancestors(parents: list[int], i: int) -> set[int]:
    out = {i}
    while parents[i] >= 0:
        i = parents[i]
        out.add(i)
    return out


@settings(max_examples=40, deadline=None)
@given(seeds)
def test_tree_mask_is_ancestor_or_self(seed):
    rng = np.random.default_rng(seed)
    tree = random_tree(rng, 2, int(rng.integers(0, 16)))
    k = int(rng.integers(0, 10))
    layout = build_layout(tree, top_k_nodes(tree, k), torch.tensor([7, 8]))
    mask = layout.tree_mask()
    for b in range(2):
        parent = layout.parent_pos[b].tolist()
        for i in range(layout.num_positions):
            if not layout.valid[b, i]:
                assert mask[b, i].tolist() == [True] + [False] * (layout.num_positions - 1)
                continue
            anc = _ancestors([p if p >= 0 else -1 for p in parent], i) | {0}
            assert {j for j in range(layout.num_positions) if mask[b, i, j]} == anc
            path = [p for p in layout.paths[b, i].tolist() if p >= 0]
            assert set(path) == anc and path[0] == 0 and path[-1] == i
        # tokens and depth follow the tree
        for pos in range(1, layout.num_positions):
            n = int(layout.node_idx[b, pos - 1])
            if n >= 0:
                assert int(layout.token_ids[b, pos]) == int(tree.token_ids[b, n])
                assert int(layout.depth[b, pos]) == int(tree.depth[b, n])


def test_attention_mask_prefix_positions_and_window():
    tree = random_tree(np.random.default_rng(1), 1, 6, pad=False)
    layout = build_layout(tree, score_order(tree), torch.tensor([3]))
    m = layout.attention_mask(prefix_len=5)
    assert m.shape == (1, 1, 7, 12) and m.dtype == torch.float32
    assert bool((m[0, 0, :, :5] == 0).all())
    assert bool(((m == 0) | (m == torch.finfo(torch.float32).min)).all())
    pos = layout.position_ids(5)
    assert pos[0, 0] == 5 and bool((pos[0] == 5 + layout.depth[0]).all())
    w = layout.attention_mask(prefix_len=5, sliding_window=3)
    q = pos[0]
    k = torch.cat([torch.arange(5), q])
    for i in range(7):
        for j in range(12):
            allowed = bool(m[0, 0, i, j] == 0) and int(q[i] - k[j]) < 3
            assert bool(w[0, 0, i, j] == 0) == allowed


def test_non_closed_or_misordered_selection_is_rejected():
    tree = random_tree(np.random.default_rng(2), 1, 5, pad=False)
    child = next(i for i in range(5) if int(tree.parents[0, i]) >= 0)
    parent = int(tree.parents[0, child])
    with pytest.raises(ValueError, match="parent-closed"):
        build_layout(tree, torch.tensor([[child]]), torch.tensor([0]))
    with pytest.raises(ValueError, match="parent-closed"):
        build_layout(tree, torch.tensor([[child, parent]]), torch.tensor([0]))


@settings(max_examples=60, deadline=None)
@given(seeds)
def test_host_layout_equals_the_tensor_path(seed):
    """CPU layouts are built on host lists; every field must equal the tensor path's (dtype too), both
    as it checks and reads the depth itself and with the caller's max depth (what the engine's CUDA
    step passes, so no flag or depth is read back between selection and verify)."""
    from trtllm_moespec.core.layout import _build_layout_host, _build_layout_tensors
    from trtllm_moespec.core.tree import gather_nodes

    rng = np.random.default_rng(seed)
    B = int(rng.integers(1, 4))
    tree = random_tree(rng, B, int(rng.integers(0, 16)))
    selection = top_k_nodes(tree, int(rng.integers(0, 12)))
    roots = torch.arange(B) + 3
    depth = int(gather_nodes(tree.depth, selection, 0).max()) if selection.numel() else 0
    host = _build_layout_host(tree, selection, roots)
    for tensors in (_build_layout_tensors(tree, selection, roots), _build_layout_tensors(tree, selection, roots, depth)):
        for name in ("node_idx", "token_ids", "depth", "parent_pos", "valid", "paths", "num_nodes"):
            a, b = getattr(host, name), getattr(tensors, name)
            assert a.dtype == b.dtype and torch.equal(a, b), name
