"""The compiled greedy acceptance of CPU requests (core/accept_host.py) against the list walk it replaces and the
tensor path: the same result on random layouts whose logits tie (the first maximum wins), long accepted chains
included, in float32 and float64; the same refusal of a visited row holding a NaN or an infinity; an unvisited
one is never read."""

from unittest.mock import patch

import numpy as np
import pytest
import torch
from hypothesis import given, settings

from trtllm_moespec.core import verify
from trtllm_moespec.core.accept_host import compiled_greedy_walk
from trtllm_moespec.core.layout import build_layout
from trtllm_moespec.core.tree import top_k_nodes

from .strategies import random_tree, seeds

pytest.importorskip("numba")

FIELDS = ("accepted_pos", "num_accepted", "emitted_ids", "num_emitted")


def _layout(rng: np.random.Generator, B: int):
    tree = random_tree(rng, B, int(rng.integers(0, 20)), vocab=3)  # a small vocabulary: long accepted chains
    return build_layout(tree, top_k_nodes(tree, int(rng.integers(0, 20))), torch.arange(B))


def _outcome(layout, logits):
    try:
        return verify._greedy_tree_host(layout, logits)
    except ValueError as e:
        return str(e)


def _both(layout, logits):
    """(compiled, list walk) outcomes: a VerifyResult or the error's message."""
    got = _outcome(layout, logits)
    with patch.object(verify, "compiled_greedy_walk", lambda: None):
        return got, _outcome(layout, logits)


@settings(max_examples=80, deadline=None)
@given(seeds)
def test_compiled_greedy_walk_equals_the_list_walk_and_the_tensor_path(seed):
    assert compiled_greedy_walk() is not None, "numba is installed: the compiled walk must be on"
    rng = np.random.default_rng(seed)
    B = int(rng.integers(1, 4))
    layout = _layout(rng, B)
    # integer logits on 3 tokens: most rows tie, and the first maximum must win as numpy's and torch's argmax
    logits = torch.from_numpy(rng.integers(0, 2, (B, layout.num_positions, 3)).astype(np.float32))
    if seed % 2:
        logits = logits.double()
    got, ref = _both(layout, logits)
    tensors = verify._greedy_tree(layout, logits)
    for name in FIELDS:
        assert torch.equal(getattr(got, name), getattr(ref, name)), name
        assert torch.equal(getattr(got, name), getattr(tensors, name)), name


@settings(max_examples=60, deadline=None)
@given(seeds)
def test_a_visited_row_that_is_not_finite_is_refused_as_by_the_list_walk(seed):
    rng = np.random.default_rng(seed)
    B = int(rng.integers(1, 3))
    layout = _layout(rng, B)
    logits = torch.from_numpy(rng.integers(0, 2, (B, layout.num_positions, 3)).astype(np.float32))
    b, pos = int(rng.integers(0, B)), int(rng.integers(0, layout.num_positions))
    logits[b, pos, int(rng.integers(0, 3))] = [float("nan"), float("inf"), -float("inf")][seed % 3]
    got, ref = _both(layout, logits)
    if isinstance(ref, str):
        assert got == ref and "NaN or inf" in got
    else:  # the row was not visited: never read, the same result
        for name in FIELDS:
            assert torch.equal(getattr(got, name), getattr(ref, name)), name


def test_a_chain_the_target_agrees_with_is_accepted_whole_with_its_bonus():
    layout = build_layout(*_chain_tree(), torch.tensor([0]))
    logits = torch.zeros(1, layout.num_positions, 5)
    for pos, token in enumerate([1, 2, 3, 4]):  # the root's argmax is node 1's token, and so on; 4: the bonus
        logits[0, pos, token] = 1.0
    got, ref = _both(layout, logits)
    assert got.accepted_pos.tolist() == ref.accepted_pos.tolist() == [[1, 2, 3]]
    assert got.emitted_ids.tolist() == ref.emitted_ids.tolist() == [[1, 2, 3, 4]]
    logits[0, 2, 0] = 2.0  # node 2's row now prefers token 0: the walk stops after node 2
    got, ref = _both(layout, logits)
    assert got.emitted_ids.tolist() == ref.emitted_ids.tolist() == [[1, 2, 0, -1]]


def test_a_nan_at_the_root_is_refused():
    layout = build_layout(*_chain_tree(), torch.tensor([0]))
    logits = torch.zeros(1, layout.num_positions, 4)
    logits[0, 0, 2] = float("nan")
    got, ref = _both(layout, logits)
    assert got == ref and "NaN or inf" in got


def _chain_tree():
    from trtllm_moespec.core import DraftTree

    tree = DraftTree.from_parents(torch.tensor([[1, 2, 3]]), torch.tensor([[-1, 0, 1]]), torch.tensor([[0.9, 0.8, 0.7]]))
    return tree, torch.tensor([[0, 1, 2]])
