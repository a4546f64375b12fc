"""The compiled expert-aware greedy, path sets and top-K bitsets (core/greedy_host.py) against the numpy and
torch paths they replace: the same picks in the same order, the same prefix sums and union sizes, the same
words, on random trees with tied scores, marginal and global costs, with and without the root's experts."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings

from trtllm_moespec.core import select
from trtllm_moespec.core.experts import pack_expert_ids
from trtllm_moespec.core.greedy_host import compiled_greedy
from trtllm_moespec.core.select import _greedy_one, _path_bits_reference, greedy_expert_select, path_bits

from .strategies import random_experts, random_tree, seeds

pytest.importorskip("numba")


def _kernels():
    kernels = compiled_greedy()
    assert kernels is not None, "numba is installed: the compiled greedy must be on"
    return kernels


def _case(seed: int):
    rng = np.random.default_rng(seed)
    tree = random_tree(rng, 1, int(rng.integers(0, 40)), vocab=6)  # quantised q: many tied scores
    layers, experts = int(rng.integers(1, 5)), int(rng.choice([8, 32, 48]))  # 48 x layers: words span 64 bits
    sets = random_experts(rng, tree, layers, experts, int(rng.integers(1, 4)), num_popular=int(rng.integers(4, 9)))
    return rng, tree, sets


@settings(max_examples=80, deadline=None)
@given(seeds)
def test_compiled_greedy_picks_as_the_numpy_greedy(seed):
    greedy_order, path_words, _ = _kernels()
    rng, tree, sets = _case(seed)
    parents, depth = tree.parents[0].numpy(), tree.depth[0].numpy()
    node = sets.bits[0].numpy()
    traj = np.empty_like(node)
    path_words(node, parents, depth, traj)
    assert np.array_equal(traj, _path_bits_reference(node[None], parents[None], depth[None])[0])
    bits = traj.view(np.uint64)
    root = np.zeros(bits.shape[1], np.uint64) if rng.random() < 0.3 else bits[int(rng.integers(len(bits)))].copy() \
        if len(bits) else np.zeros(bits.shape[1], np.uint64)
    scores = tree.scores[0].double().numpy()
    M = int(rng.integers(0, tree.num_nodes + 2))
    M = min(M, tree.num_nodes)
    for marginal in (True, False):
        token_cost, expert_cost = float(rng.choice([1e-3, 0.5, 2.0])), float(rng.choice([0.0, 1.0, 0.03]))
        want = [np.full(max(M, 1), -1, np.int64), np.zeros(M + 1), np.zeros(M + 1, np.int64)]
        got = [a.copy() for a in want]
        n_want, _ = _greedy_one(scores, parents, tree.valid[0].numpy(), bits, root.copy(), M, token_cost, expert_cost,
                                marginal, *want)
        n_got = greedy_order(scores, parents, tree.valid[0].numpy(), bits, root.copy(), M, token_cost, expert_cost,
                             marginal, *got)
        assert n_got == n_want
        for a, b in zip(got, want):
            assert np.array_equal(a, b), (marginal, a, b)


def test_the_greedy_takes_the_compiled_path_and_selects_as_numpy(monkeypatch):
    """greedy_expert_select's compiled branch (batch of trees, root buffer) equals its numpy branch."""
    rng = np.random.default_rng(3)
    tree = random_tree(rng, 3, 30, vocab=5)
    sets = random_experts(rng, tree, 3, 16, 2, num_popular=6)
    traj = path_bits(sets.bits, tree.parents, tree.depth)
    root = sets.bits[:, 0]
    compiled = greedy_expert_select(tree.scores, tree.parents, tree.valid, traj, root, 8, 1e-3, 1.0)
    monkeypatch.setattr(select, "compiled_greedy", lambda: None)
    assert torch.equal(path_bits(sets.bits, tree.parents, tree.depth), traj)
    reference = greedy_expert_select(tree.scores, tree.parents, tree.valid, traj, root, 8, 1e-3, 1.0)
    for field in ("node_idx", "num_selected", "cu_scores", "unique_experts"):
        assert torch.equal(getattr(compiled, field), getattr(reference, field)), field
    assert int(compiled.num_selected.min()) > 0


@settings(max_examples=40, deadline=None)
@given(seeds)
def test_topk_words_are_the_packed_top_k(seed):
    _, _, topk_words = _kernels()
    rng = np.random.default_rng(seed)
    M, L, E, k = int(rng.integers(1, 9)), int(rng.integers(1, 6)), int(rng.choice([8, 32, 48])), int(rng.integers(1, 5))
    logits = torch.from_numpy(rng.normal(size=(M, L, E)).astype(np.float32))  # continuous: no ties
    out = np.empty((M, pack_expert_ids(torch.zeros(1, L, k, dtype=torch.int64), E).shape[-1]), np.int64)
    topk_words(logits.numpy(), k, out)
    want = pack_expert_ids(logits.topk(k, dim=-1).indices, E)
    assert np.array_equal(out, want.numpy())


def test_topk_words_break_exact_ties_toward_the_lower_expert():
    _, _, topk_words = _kernels()
    logits = np.zeros((1, 1, 8), np.float32)
    logits[0, 0, 5] = 1.0
    out = np.empty((1, 1), np.int64)
    topk_words(logits, 3, out)
    assert out[0, 0] == (1 << 5) | (1 << 0) | (1 << 1)
