"""TensorRT-LLM dynamic-tree buffers <-> DraftTree, on hand-built tensors of TRT-LLM's shapes."""

import pytest
import torch

from trtllm_moespec.backends.trtllm.buffers import (
    DynamicTreeHistory,
    chain_prefix_length,
    chain_tree,
    draft_tree_from_history,
    history_parent_index,
    history_size,
    parent_buffer_size,
    selected_parent_positions,
    top_n_resampling,
)
from trtllm_moespec.backends.trtllm.padding import pad_with_copies
from trtllm_moespec.core.tree import draft_root, grow_tree, score_order


def fill_history(root_ids, root_probs, step_ids, step_probs):
    """Fill the worker's three history buffers the way its draft loop does.

    root_*: [B, K]; step_*: list over steps 1..D-1 of [B, K, K] (child c of frontier slot f).
    Frontier at each step = top-K of the K*K path scores (descending), as TRT-LLM does.
    """
    B, K = root_ids.shape
    D = 1 + len(step_ids)
    H, P = history_size(K, D), parent_buffer_size(K, D)
    tokens = torch.zeros(B, H, dtype=torch.int32)
    scores = torch.zeros(B, H, dtype=torch.float32)
    parents = torch.zeros(B, P, dtype=torch.int64)
    tokens[:, :K], scores[:, :K] = root_ids.int(), root_probs
    parents[:, : K + 1] = torch.arange(-1, K)
    prev_scores = root_probs
    for l, (ids, probs) in enumerate(zip(step_ids, step_probs), start=1):
        flat_scores = (probs * prev_scores[:, :, None]).reshape(B, K * K)
        start = K + (l - 1) * K * K
        tokens[:, start : start + K * K] = ids.reshape(B, K * K).int()
        scores[:, start : start + K * K] = flat_scores
        top_vals, top_idx = flat_scores.topk(K, dim=1)
        if l < D - 1:
            parents[:, l * K + 1 : l * K + 1 + K] = top_idx + K * K * (l - 1) + K
        prev_scores = top_vals
    return DynamicTreeHistory(tokens, scores, parents, topk=K, max_draft_len=D)


def random_draft(B, K, D, seed, vocab=1000):
    g = torch.Generator().manual_seed(seed)

    def probs(*shape):
        p = torch.rand(*shape, K, generator=g) + 0.05
        return (p / p.sum(-1, keepdim=True) * 0.95).sort(-1, descending=True).values

    def ids(*shape):  # distinct siblings
        return torch.stack([torch.randperm(vocab, generator=g)[:K] for _ in range(int(torch.tensor(shape).prod()))]).reshape(*shape, K)

    return ids(B), probs(B), [ids(B, K) for _ in range(D - 1)], [probs(B, K) for _ in range(D - 1)]


@pytest.mark.parametrize("B,K,D", [(1, 1, 1), (2, 2, 3), (3, 4, 4), (2, 8, 4)])
def test_history_shapes_and_tree_equal_core_eagle_growth(B, K, D):
    root_ids, root_probs, step_ids, step_probs = random_draft(B, K, D, seed=B * 100 + K * 10 + D)
    history = fill_history(root_ids, root_probs, step_ids, step_probs)
    assert history.draft_tokens.shape == (B, K + K * K * (D - 1))
    assert history.parents.shape == (B, max(K * (D - 1) + 1, K + 1))
    tree = draft_tree_from_history(history)
    tree.validate()

    ref, frontier = draft_root(root_ids, root_probs)
    for ids, probs in zip(step_ids, step_probs):
        ref, frontier = grow_tree(ref, frontier, ids, probs, K)
    assert torch.equal(tree.token_ids, ref.token_ids)
    assert torch.equal(tree.parents, ref.parents)
    assert torch.equal(tree.depth, ref.depth)
    torch.testing.assert_close(tree.scores, ref.scores, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(tree.draft_probs, ref.draft_probs, rtol=1e-4, atol=1e-6)


def test_parent_rule_on_a_hand_built_k2_d3_history():
    # K=2, D=3: history = 2 roots + 4 step-1 children + 4 step-2 children = 10 nodes.
    # Step-1 frontier picked history nodes 5 and 2 -> parent buffer [-1, 0, 1, 5, 2].
    parents = torch.tensor([[-1, 0, 1, 5, 2]])
    got = history_parent_index(parents, topk=2, num_history=10)
    assert got.tolist() == [[-1, -1, 0, 0, 1, 1, 5, 5, 2, 2]]


def test_top_n_resampling_is_sorted_and_parent_closed():
    history = fill_history(*random_draft(3, 8, 4, seed=7))
    tokens, indices = top_n_resampling(history, 32)
    assert indices.shape == (3, 32) and tokens.dtype == history.draft_tokens.dtype
    assert (indices.diff(dim=1) > 0).all()
    selected_parent_positions(history, indices)  # raises if not parent-closed


def test_a_full_score_prefix_needs_no_padding_and_equals_trtllm_top_n():
    history = fill_history(*random_draft(2, 4, 3, seed=3))
    tree = draft_tree_from_history(history)
    out = pad_with_copies(history, tree, score_order(tree)[:, :8], 8)
    assert out.num_selected.tolist() == [8, 8] and not out.is_copy.any() and out.num_extended.tolist() == [0, 0]
    tokens, indices = top_n_resampling(history, 8)
    assert torch.equal(out.topk_score_indices, indices) and torch.equal(out.draft_tokens, tokens)


def test_padding_of_a_non_prefix_selection_is_parent_closed():
    history = fill_history(*random_draft(1, 4, 3, seed=11))
    tree = draft_tree_from_history(history)
    # Pick a low-score leaf's path: root child 3 and one of its children (history 4 + f*4 + c).
    deep_parent = history_parent_index(history.parents, 4, tree.num_nodes)
    child = int((deep_parent[0] == 3).nonzero()[0])
    out = pad_with_copies(history, tree, torch.tensor([[3, child, -1, -1]]), 6)
    assert {3, child} <= set(out.topk_score_indices[0].tolist()) and len(set(out.topk_score_indices[0].tolist())) == 6
    padded = DynamicTreeHistory(history.draft_tokens, history.scores, out.parents, 4, 3)
    pos = selected_parent_positions(padded, out.topk_score_indices)
    assert (pos < torch.arange(6)).all()  # parents precede children in the ascending layout


def test_bad_inputs_raise():
    history = fill_history(*random_draft(1, 2, 3, seed=1))
    with pytest.raises(ValueError, match="unselected parent"):
        selected_parent_positions(history, torch.tensor([[0, 6]]))  # 6's parent is a step-1 node
    wrong = DynamicTreeHistory(history.draft_tokens[:, :5], history.scores, history.parents, 2, 3)
    with pytest.raises(ValueError, match="expected"):
        wrong.validate()


def test_chain_tree_and_prefix_length():
    tree = chain_tree(torch.tensor([[5, 6, 7, 8]]), torch.tensor([[0.9, 0.5, 0.5, 0.1]]))
    assert tree.parents.tolist() == [[-1, 0, 1, 2]] and tree.depth.tolist() == [[1, 2, 3, 4]]
    assert chain_prefix_length(torch.tensor([[0, 1, -1, -1], [-1, -1, -1, -1]])).tolist() == [2, 0]
    with pytest.raises(ValueError, match="prefix"):
        chain_prefix_length(torch.tensor([[0, 2, -1, -1]]))
