"""The learned acceptance head: node features on hand-built trees, persistence, bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trtllm_moespec.core.tree import DraftTree
from trtllm_moespec.models.acceptance_head import (
    NUM_SCALARS, AcceptanceHead, copy_features, node_scalars, sibling_rank, write_random_acceptance_head,
)


def _tree():
    # root -> 0 ("5", q .3), 1 ("7", q .6); 0 -> 2 ("9", q .5), 3 ("4", q .5)
    return DraftTree.from_parents(torch.tensor([[5, 7, 9, 4]]), torch.tensor([[-1, -1, 0, 0]]),
                                  torch.tensor([[0.3, 0.6, 0.5, 0.5]]))


def test_sibling_rank_orders_by_q_then_index():
    assert sibling_rank(_tree()).tolist() == [1, 0, 0, 1]


def test_copy_features_match_the_context():
    # context ... 3 5 9 ... 3 5 4 ... 3 (root = 3): after "3" came 5 (twice); after "3 5" came 9 then 4.
    context = [3, 5, 9, 1, 3, 5, 4, 2, 3]
    f = copy_features(_tree(), context)
    # order-1 columns (any, most recent): node 0 = "5" follows "3" -> (1, 1); node 1 = "7" never -> (0, 0)
    assert f[0, :2].tolist() == [1.0, 1.0] and f[1, :2].tolist() == [0.0, 0.0]
    # order-2 for node 2 ("9" after "3 5") seen but not most recent; node 3 ("4") is the most recent
    assert f[2, 2:4].tolist() == [1.0, 0.0] and f[3, 2:4].tolist() == [1.0, 1.0]
    assert node_scalars(_tree(), context).shape == (4, NUM_SCALARS)


def test_round_trip_and_local_probabilities(tmp_path):
    path = write_random_acceptance_head(tmp_path / "h", hidden_size=8, embed_size=6, vocab_size=12)
    head = AcceptanceHead.load(path)
    head.bind_embedding(torch.nn.Embedding(12, 6))

    class Draft:
        node_hidden = torch.randn(1, 4, 8)

    p = head.local(_tree(), Draft(), [1, 2, 3])
    assert p.shape == (1, 4) and bool(((p > 0) & (p < 1)).all())
    with pytest.raises(ValueError, match="node_hidden"):
        head.local(_tree(), None, [1])
    with pytest.raises(ValueError, match="does not match"):
        AcceptanceHead.load(path).bind_embedding(torch.nn.Embedding(13, 6))
    (path / "config.json").write_text('{"head_type": "other"}')
    with pytest.raises(ValueError, match="head_type"):
        AcceptanceHead.load(path)
    with pytest.raises(FileNotFoundError):
        AcceptanceHead.load(tmp_path / "missing")
    assert np.isfinite(node_scalars(_tree(), [])).all()
