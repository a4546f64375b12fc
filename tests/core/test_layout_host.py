"""The compiled layout of one CPU request (core/layout_host.py) against the list path it replaces: the same
layout, field by field, for selections in score order, with padding between and after, and the same
error for a selection out of range, of a padded node, or not parent-closed."""

from unittest.mock import patch

import numpy as np
import pytest
import torch
from hypothesis import given, settings

from trtllm_moespec.core import DraftTree, layout
from trtllm_moespec.core.layout import build_layout
from trtllm_moespec.core.layout_host import compiled_layout
from trtllm_moespec.core.tree import score_order

from .strategies import random_eagle_tree, random_tree, seeds

pytest.importorskip("numba")

FIELDS = ("node_idx", "token_ids", "depth", "parent_pos", "valid", "paths", "num_nodes")


def _both(tree: DraftTree, sel: torch.Tensor, root: torch.Tensor):
    """(compiled, list path) outcome of build_layout: the layout, or the error's type and message."""
    def run():
        try:
            return build_layout(tree, sel, root)
        except (ValueError, IndexError) as e:
            return type(e), str(e)
    got = run()
    with patch.object(layout, "compiled_layout", lambda: None):
        return got, run()


def _selection(tree: DraftTree, rng: np.random.Generator) -> torch.Tensor:
    """A parent-closed prefix of the score order, with -1 pads spread through it and after it."""
    order = score_order(tree)[0]
    k = int(rng.integers(0, int(tree.valid.sum()) + 1))
    picked = order[:k].tolist()
    for _ in range(int(rng.integers(0, 4))):
        picked.insert(int(rng.integers(0, len(picked) + 1)), -1)
    return torch.tensor([picked], dtype=torch.int64).reshape(1, -1)


@settings(max_examples=80, deadline=None)
@given(seeds)
def test_compiled_layout_equals_the_list_path(seed):
    assert compiled_layout() is not None
    rng = np.random.default_rng(seed)
    tree = random_eagle_tree(rng, 1, int(rng.integers(1, 5)), int(rng.integers(1, 5)), vocab=12) \
        if seed % 2 else random_tree(rng, 1, int(rng.integers(1, 30)), vocab=5)
    sel, root = _selection(tree, rng), torch.tensor([int(rng.integers(0, 50))])
    if seed % 5 == 1 and sel.shape[1] > 1:  # break it: a node before its parent, or a padded or missing node
        how = seed % 3
        if how == 0:
            sel = sel.flip(1)
        elif how == 1 and (~tree.valid[0]).any():
            sel[0, -1] = int(torch.nonzero(~tree.valid[0])[0])
        else:
            sel[0, -1] = tree.num_nodes + int(rng.integers(0, 3))
    got, want = _both(tree, sel, root)
    if isinstance(want, tuple):
        assert got == want
        return
    for name in FIELDS:
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), name


def test_an_empty_tree_lays_out_the_root_alone_and_refuses_a_selection():
    empty = DraftTree.empty(1)
    got, want = _both(empty, torch.full((1, 3), -1, dtype=torch.int64), torch.tensor([7]))
    for name in FIELDS:
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    got, want = _both(empty, torch.tensor([[0]]), torch.tensor([7]))
    assert got == want == (ValueError, "selection names nodes but the tree is empty")
