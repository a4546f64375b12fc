"""The device layout path with the caller's max depth (what the engine's CUDA step passes, so no
flag or depth is read back between selection and verify) builds the same layout as the host path."""

import numpy as np
import torch
from hypothesis import given, settings

from trtllm_moespec.core import top_k_nodes
from trtllm_moespec.core.layout import _build_layout_host, _build_layout_tensors
from trtllm_moespec.core.tree import gather_nodes

from .strategies import random_tree, seeds


@settings(max_examples=40, deadline=None)
@given(seeds)
def test_tensor_layout_with_a_known_max_depth_equals_the_host_layout(seed):
    rng = np.random.default_rng(seed)
    B = int(rng.integers(1, 4))
    tree = random_tree(rng, B, int(rng.integers(0, 16)))
    selection = top_k_nodes(tree, int(rng.integers(0, 12)))
    roots = torch.arange(B) + 3
    depth = int(gather_nodes(tree.depth, selection, 0).max()) if selection.numel() else 0
    host, tensors = _build_layout_host(tree, selection, roots), _build_layout_tensors(tree, selection, roots, depth)
    for name in ("node_idx", "token_ids", "depth", "parent_pos", "valid", "paths", "num_nodes"):
        a, b = getattr(host, name), getattr(tensors, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
