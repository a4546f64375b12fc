"""Random trees and expert sets for property tests."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import strategies as st

from trtllm_moespec.core import DraftTree, ExpertSets, draft_root, grow_tree


def random_tree(rng: np.random.Generator, batch: int, num_nodes: int, vocab: int = 50, pad: bool = True) -> DraftTree:
    """Random trees of any shape: parents < index, distinct sibling tokens, q in (0, 1]."""
    tokens = np.zeros((batch, num_nodes), dtype=np.int64)
    parents = np.full((batch, num_nodes), -1, dtype=np.int64)
    valid = np.ones((batch, num_nodes), dtype=bool)
    for b in range(batch):
        n_valid = int(rng.integers(0, num_nodes + 1)) if pad else num_nodes
        used: dict[int, set[int]] = {}
        for i in range(num_nodes):
            if i >= n_valid:
                valid[b, i] = False
                continue
            p = int(rng.choice([q for q in range(-1, i) if len(used.get(q, ())) < vocab]))
            parents[b, i] = p
            taken = used.setdefault(p, set())
            tok = int(rng.choice([t for t in range(vocab) if t not in taken]))
            taken.add(tok)
            tokens[b, i] = tok
    # Quantised probabilities make exact ties (and their tie-breaking) likely.
    q = rng.integers(1, 9, size=(batch, num_nodes)) / 8.0
    return DraftTree.from_parents(torch.from_numpy(tokens), torch.from_numpy(parents), torch.from_numpy(q).float(),
                                  torch.from_numpy(valid))


def random_eagle_tree(rng: np.random.Generator, batch: int, steps: int, topk: int, vocab: int = 100) -> DraftTree:
    """An EAGLE (steps, topk) tree with random drafter outputs."""
    def step(shape):
        probs = rng.dirichlet(np.ones(vocab), size=shape)
        ids = np.argsort(-probs, axis=-1)[..., :topk]
        return torch.from_numpy(ids), torch.from_numpy(np.take_along_axis(probs, ids, -1)).float()

    ids, p = step((batch,))
    tree, frontier = draft_root(ids, p)
    for _ in range(steps - 1):
        ids, p = step((batch, topk))
        tree, frontier = grow_tree(tree, frontier, ids, p, topk)
    return tree


def random_experts(rng: np.random.Generator, tree: DraftTree, layers: int, experts: int, topk: int,
                   num_popular: int | None = None) -> ExpertSets:
    """Per-node top-k experts; `num_popular` concentrates routing so overlaps happen."""
    B, N = tree.token_ids.shape
    pool = experts if num_popular is None else num_popular
    ids = np.stack([[[rng.choice(pool, size=topk, replace=False) for _ in range(layers)] for _ in range(N)]
                    for _ in range(B)]) if N else np.zeros((B, 0, layers, topk), dtype=np.int64)
    return ExpertSets.from_topk_ids(torch.from_numpy(ids.astype(np.int64)), experts)


seeds = st.integers(0, 2**31 - 1)
