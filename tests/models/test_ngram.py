"""N-gram / prompt-lookup drafter: hand-built contexts with known trees, validity, bad options."""

import pytest
import torch

from trtllm_moespec.models.ngram import NgramConfig, NgramDrafter


def test_known_tree_from_two_matches():
    # suffix (1, 2, 3) occurred twice: followed by 4 5 ... and by 9 9 ...
    drafter = NgramDrafter(NgramConfig(max_ngram=3, max_depth=2, smoothing=0.0))
    tree = drafter.draft_tree([1, 2, 3, 4, 5, 1, 2, 3, 9, 9, 1, 2, 3])
    # most recent of the equally long matches first
    assert tree.token_ids.tolist() == [[9, 9, 4, 5]]
    assert tree.parents.tolist() == [[-1, 0, -1, 2]]
    torch.testing.assert_close(tree.draft_probs, torch.tensor([[0.5, 1.0, 0.5, 1.0]]))
    torch.testing.assert_close(tree.scores, torch.tensor([[0.5, 0.5, 0.5, 0.5]]))


def test_shared_prefixes_merge_and_longer_matches_weigh_more():
    drafter = NgramDrafter(NgramConfig(max_ngram=2, max_depth=2, smoothing=1.0))
    # suffix (7, 8): full match before 5 6; the 1-gram (8) also matches before 5 0
    tree = drafter.draft_tree([7, 8, 5, 6, 3, 8, 5, 0, 7, 8])
    assert tree.token_ids.tolist() == [[5, 6, 0]] and tree.parents.tolist() == [[-1, 0, 0]]
    # weights: node 5 = 2 + 1, node 6 = 2, node 0 = 1; root weight 3; q = w / (w_parent + 1)
    torch.testing.assert_close(tree.draft_probs, torch.tensor([[3 / 4, 2 / 4, 1 / 4]]))
    tree.validate()


def test_random_histories_give_valid_trees_with_distinct_siblings():
    gen = torch.Generator().manual_seed(0)
    drafter = NgramDrafter(NgramConfig(max_nodes=16))
    for _ in range(30):
        ctx = torch.randint(0, 6, (int(torch.randint(1, 60, (1,), generator=gen)),), generator=gen)
        tree = drafter.draft_tree(ctx)
        tree.validate()
        assert tree.num_nodes <= 16
        pairs = list(zip(tree.parents[0].tolist(), tree.token_ids[0].tolist()))
        assert len(pairs) == len(set(pairs))
        assert bool(((tree.draft_probs > 0) & (tree.draft_probs <= 1)).all())


def test_no_match_gives_an_empty_tree():
    assert NgramDrafter().draft_tree([1, 2, 3, 4]).num_nodes == 0
    assert NgramDrafter().draft_tree(torch.tensor([5])).num_nodes == 0


@pytest.mark.parametrize("bad", [dict(min_ngram=0), dict(min_ngram=4, max_ngram=3), dict(max_nodes=0),
                                 dict(smoothing=-1.0)])
def test_bad_options_raise(bad):
    with pytest.raises(ValueError):
        NgramConfig(**bad)
