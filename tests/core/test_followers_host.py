"""The compiled copy features (core/followers_host.py) against `node_features.copy_features` and
`copies_recent`: the same flags on random trees (some nodes invalid) over contexts that grow step by step
(the tables kept between steps, grown as the context doubles), restart (a context that does not extend the
last), and are shorter than the n-grams."""

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given, settings

from trtllm_moespec.core.followers_host import compiled_followers, copy_flags_of
from trtllm_moespec.core.node_features import ContextFollowers, copies_recent, copy_features
from trtllm_moespec.core.tree import DraftTree

from .strategies import random_eagle_tree, seeds

pytest.importorskip("numba")


def _compiled_flags(index: ContextFollowers, tree: DraftTree, context: list[int]) -> np.ndarray:
    out = np.full((tree.num_nodes, 6), 7, dtype=np.float32)
    assert copy_flags_of(tree, context, index, out)
    return out


@settings(max_examples=40, deadline=None)
@given(seeds)
def test_compiled_flags_equal_the_reference_as_the_context_grows(seed):
    assert compiled_followers() is not None
    rng = np.random.default_rng(seed)
    vocab = int(rng.integers(2, 8))  # few tokens: many repeated n-grams, many copies
    index, context = ContextFollowers(), [int(t) for t in rng.integers(0, vocab, int(rng.integers(0, 3)))]
    for step in range(12):
        tree = random_eagle_tree(rng, 1, int(rng.integers(1, 4)), min(int(rng.integers(1, 4)), vocab), vocab=vocab)
        tree = dataclasses.replace(tree, valid=torch.from_numpy(rng.random(tree.token_ids.shape) < 0.9))
        got = _compiled_flags(index, tree, context)
        np.testing.assert_array_equal(got, copy_features(tree, context), err_msg=f"step {step}, context {context}")
        assert got[:, 3].astype(np.int64).tolist() == copies_recent(tree, context).tolist()
        recent_only = np.full_like(got, 7)  # the calibrated values' call: the most recent followers alone
        assert copy_flags_of(tree, context, index, recent_only, with_seen=False)
        np.testing.assert_array_equal(recent_only[:, 1::2], got[:, 1::2])
        assert not recent_only[:, ::2].any()
        if step == 6:  # another request's context: the tables start again
            context = [int(t) for t in rng.integers(0, vocab, 3)]
        else:  # committed tokens, sometimes enough to double the context
            context = context + [int(t) for t in rng.integers(0, vocab, int(rng.integers(1, 40)))]


def test_a_copy_is_flagged_at_the_root_and_deeper():
    # context 5 6 7 5 6: (5, 6) was followed by 7, (6, 7) by 5; a root child 7 copies, and its child 5 too
    tree = DraftTree.from_parents(torch.tensor([[7, 8, 5, 9]]), torch.tensor([[-1, -1, 0, 0]]),
                                  torch.tensor([[0.5, 0.4, 0.6, 0.3]]))
    got = _compiled_flags(ContextFollowers(), tree, [5, 6, 7, 5, 6])
    assert got[:, 3].tolist() == copies_recent(tree, [5, 6, 7, 5, 6]).tolist() == [1, 0, 1, 0]
    # 4-grams: (6, 7, 5, 6) never occurred, so no node has a 4-gram flag; (7, 5, 6, 7) would need 5 tokens more
    assert got[:, 4:].sum() == 0
    np.testing.assert_array_equal(got, copy_features(tree, [5, 6, 7, 5, 6]))


def test_a_4gram_follower_is_told_from_the_most_recent_one():
    # 1 2 3 4 was followed by 9, then by 8: 9 was seen (any), 8 is the most recent
    context = [1, 2, 3, 4, 9, 1, 2, 3, 4, 8, 1, 2, 3, 4]
    tree = DraftTree.from_parents(torch.tensor([[9, 8, 5]]), torch.tensor([[-1, -1, -1]]),
                                  torch.tensor([[0.5, 0.3, 0.2]]))
    got = _compiled_flags(ContextFollowers(), tree, context)
    assert got[:, 4].tolist() == [1, 1, 0] and got[:, 5].tolist() == [0, 1, 0]
    np.testing.assert_array_equal(got, copy_features(tree, context))


def test_the_tables_grow_with_the_context_and_keep_every_follower():
    """From 2 to ~400 tokens, a few at a time: the tables are rebuilt larger as the context doubles, and the
    flags stay the reference's at every step."""
    rng = np.random.default_rng(3)
    index, context, capacities = ContextFollowers(), [1, 2], set()
    while len(context) < 400:
        tree = random_eagle_tree(rng, 1, 3, 3, vocab=6)
        np.testing.assert_array_equal(_compiled_flags(index, tree, context), copy_features(tree, context))
        capacities.add(index.table.seen.shape[0])
        context = context + [int(t) for t in rng.integers(0, 6, int(rng.integers(1, 12)))]
    assert len(capacities) >= 4  # 64, then larger tables as it doubled
