"""The learned acceptance head: node features on hand-built trees, persistence, bad input."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from trtllm_moespec.core.node_features import NGRAM_ORDERS, ContextFollowers
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


def _reference_copy_features(tree: DraftTree, context: list[int]) -> np.ndarray:
    """The copy features read plainly: every node walks its own path and scans the whole context."""
    tokens, parents = tree.token_ids[0].tolist(), tree.parents[0].tolist()
    out = np.zeros((len(tokens), 2 * len(NGRAM_ORDERS)), dtype=np.float32)
    for v, tok in enumerate(tokens):
        if not bool(tree.valid[0, v]):
            continue
        path, u = [], parents[v]
        while u >= 0:
            path.append(tokens[u])
            u = parents[u]
        seq = context + path[::-1]
        for j, n in enumerate(NGRAM_ORDERS):
            if len(seq) < n:
                continue
            key = seq[-n:]
            follows = [context[i + n] for i in range(len(context) - n) if context[i:i + n] == key]
            out[v, 2 * j] = tok in follows
            out[v, 2 * j + 1] = bool(follows) and follows[-1] == tok
    return out


def _random_tree(gen: torch.Generator, vocab: int, width: int = 3, depth: int = 3) -> DraftTree:
    parents, level = [], [-1]
    for _ in range(depth):
        nxt = []
        for p in level:
            for _ in range(width):
                nxt.append(len(parents))
                parents.append(p)
        level = nxt[:width]
    n = len(parents)
    return DraftTree.from_parents(torch.randint(0, vocab, (1, n), generator=gen), torch.tensor([parents]),
                                  torch.rand(1, n, generator=gen) * 0.9 + 0.05)


def test_incremental_copy_features_match_the_plain_reading():
    gen = torch.Generator().manual_seed(0)
    followers = ContextFollowers()
    for request in range(2):  # a second request's context is no extension: the index starts again
        context = torch.randint(0, 5, (6,), generator=gen).tolist()
        for _ in range(12):
            tree = _random_tree(gen, 5)
            got = copy_features(tree, context, followers)
            assert np.array_equal(got, _reference_copy_features(tree, context)), (request, context)
            assert np.array_equal(copy_features(tree, context), got)  # a fresh index reads the same
            context += torch.randint(0, 5, (int(torch.randint(1, 4, (1,), generator=gen)),), generator=gen).tolist()
    assert got[:, 0].any() and not got[:, -1].all()  # the features vary


@pytest.mark.parametrize("compiled", ["1", "0"])  # the numba path (acceptance_head_host.py) and the torch one
def test_local_projects_the_shared_hidden_once_per_parent_and_equals_the_whole_forward(tmp_path, monkeypatch, compiled):
    monkeypatch.setenv("MOESPEC_FUSED_VALUES", compiled)
    head = AcceptanceHead.load(write_random_acceptance_head(tmp_path / "h", hidden_size=8, embed_size=6, vocab_size=12))
    embed = torch.nn.Embedding(12, 6)
    head.bind_embedding(embed)
    gen = torch.Generator().manual_seed(1)
    tree = _random_tree(gen, 12)
    parents = tree.parents[0]
    per_parent = torch.randn(len(parents) + 1, 8, generator=gen)

    class Draft:  # the drafter's contract: siblings carry the hidden of the forward that proposed them
        node_hidden = per_parent[parents.clamp(min=-1) + 1][None]

    context = [1, 2, 3, 1, 2]
    got = head.local(tree, Draft(), context)
    with torch.no_grad():
        want = torch.sigmoid(head.model(Draft.node_hidden[0], head.model.token_part(embed(tree.token_ids[0])),
                                        tree.depth[0], torch.from_numpy(sibling_rank(tree)),
                                        torch.from_numpy(node_scalars(tree, context))))
    torch.testing.assert_close(got[0], want, rtol=1e-5, atol=1e-6)
    assert float(want.std()) > 1e-3  # nodes differ


@pytest.mark.parametrize("compiled", ["1", "0"])
def test_local_reads_the_drafters_forward_rows_and_scores_only_valid_nodes(tmp_path, monkeypatch, compiled):
    """An EAGLE-3 draft hands its forward rows (node v proposed by row v // topk), as the engine's `Draft`
    wraps it; both paths give the whole forward's probabilities on valid nodes and 0 elsewhere, with the
    context index kept from step to step."""
    monkeypatch.setenv("MOESPEC_FUSED_VALUES", compiled)
    head = AcceptanceHead.load(write_random_acceptance_head(tmp_path / "h", hidden_size=8, embed_size=6, vocab_size=12))
    embed = torch.nn.Embedding(12, 6)
    head.bind_embedding(embed)
    gen = torch.Generator().manual_seed(2)
    followers, context = ContextFollowers(), [1, 2, 3, 1, 2, 3, 1]
    for _ in range(3):
        tree = _random_tree(gen, 12)  # width 3: nodes 3r .. 3r + 2 come from forward row r
        valid = torch.rand(tree.token_ids.shape, generator=gen) < 0.8
        tree = dataclasses.replace(tree, valid=valid)
        rows = torch.randn(1, tree.num_nodes // 3 + 1, 8, generator=gen)

        class Drafted:
            row_hidden, topk = rows, 3
            node_hidden = rows.repeat_interleave(3, dim=1)[:, :tree.num_nodes]

        class Draft:  # the engine's wrapper
            drafted = Drafted()

        got = head.local(tree, Draft(), context, followers)
        with torch.no_grad():
            want = torch.sigmoid(head.model(Drafted.node_hidden[0], head.model.token_part(embed(tree.token_ids[0])),
                                            tree.depth[0], torch.from_numpy(sibling_rank(tree)),
                                            torch.from_numpy(node_scalars(tree, context))))
        torch.testing.assert_close(got[0], torch.where(valid[0], want, 0.0), rtol=1e-5, atol=1e-6)
        assert bool((got[0][valid[0]] > 0).all())
        context = context + tree.token_ids[0, :2].tolist()
