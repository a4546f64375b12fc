"""The compiled copy feature (core/followers_host.py) against `node_features.copies_recent`: the same
flags on random trees over contexts that grow step by step (the table kept between steps, grown past
half full), restart (a context that does not extend the last), and are one or two tokens long."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings

from trtllm_moespec.core.followers_host import BigramFollowers, compiled_followers
from trtllm_moespec.core.node_features import copies_recent
from trtllm_moespec.core.tree import DraftTree

from .strategies import random_eagle_tree, seeds

pytest.importorskip("numba")


def _compiled_copies(table: BigramFollowers, tree: DraftTree, context: list[int]) -> np.ndarray:
    insert, copies_of = compiled_followers()
    out = np.full(tree.num_nodes, 7, dtype=np.int64)
    copies_of(tree.token_ids[0].numpy(), tree.parents[0].numpy(), tree.valid[0].numpy(), table.update(context, insert),
              table.keys, table.values, out)
    return out


@settings(max_examples=40, deadline=None)
@given(seeds)
def test_compiled_copies_equal_copies_recent_as_the_context_grows(seed):
    assert compiled_followers() is not None
    rng = np.random.default_rng(seed)
    vocab = int(rng.integers(2, 8))  # few tokens: many repeated bigrams, many copies
    table, context = BigramFollowers(), [int(t) for t in rng.integers(0, vocab, int(rng.integers(1, 3)))]
    for step in range(12):
        tree = random_eagle_tree(rng, 1, int(rng.integers(1, 4)), min(int(rng.integers(1, 4)), vocab), vocab=vocab)
        got = _compiled_copies(table, tree, context)
        assert got.tolist() == copies_recent(tree, context).tolist(), (step, context)
        if step == 6:  # another request's context: the table starts again
            context = [int(t) for t in rng.integers(0, vocab, 3)]
        else:  # committed tokens, sometimes enough to pass half the table
            context = context + [int(t) for t in rng.integers(0, vocab, int(rng.integers(1, 40)))]
    assert 2 * len(context) <= len(table.keys) or len(table.context) < len(context)


def test_a_copy_is_flagged_at_the_root_and_deeper():
    # context 5 6 7 5 6: (5, 6) was followed by 7, (6, 7) by 5; a root child 7 copies, and its child 5 too
    tree = DraftTree.from_parents(torch.tensor([[7, 8, 5, 9]]), torch.tensor([[-1, -1, 0, 0]]),
                                  torch.tensor([[0.5, 0.4, 0.6, 0.3]]))
    got = _compiled_copies(BigramFollowers(), tree, [5, 6, 7, 5, 6])
    assert got.tolist() == copies_recent(tree, [5, 6, 7, 5, 6]).tolist() == [1, 0, 1, 0]
