"""Weightless n-gram / prompt-lookup drafter (the "Lookahead" baseline of the EVICT paper).

For the committed context x_0..x_{T-1} (the root is x_{T-1}), every earlier position j
whose preceding n tokens equal the context's last n tokens (n from `max_ngram` down to
`min_ngram`; each j counts once, with its longest match) proposes the continuation
x_j, x_{j+1}, ... . Continuations are merged into a trie, so siblings are distinct,
and each node gets weight w = sum over the continuations through it of their match
length. The local draft probability is q(child) = w(child) / (w(parent) + smoothing)
(root: w(parent) = total weight), so many long agreeing matches give scores near 1
and a single short match gives a modest one, which is what selection policies need.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..core.tree import DraftTree


@dataclass(frozen=True)
class NgramConfig:
    """Knobs of the n-gram drafter."""

    max_ngram: int = 3  # longest suffix matched against the history
    min_ngram: int = 1  # shortest suffix that still proposes continuations
    max_matches: int = 8  # continuations merged into the tree (longest match, then most recent, first)
    max_depth: int = 8  # tokens per continuation
    max_nodes: int = 32  # tree size cap
    smoothing: float = 1.0  # pseudo-weight in q's denominator (0 = raw frequencies)

    def __post_init__(self) -> None:
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {self.min_ngram}, {self.max_ngram}")
        for name in ("max_matches", "max_depth", "max_nodes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.smoothing < 0:
            raise ValueError(f"smoothing must be >= 0, got {self.smoothing}")


class NgramDrafter:
    """Builds a draft tree from earlier occurrences of the context's suffix."""

    def __init__(self, config: NgramConfig | None = None):
        self.config = config or NgramConfig()

    def draft_tree(self, context: torch.Tensor | list[int]) -> DraftTree:
        """Draft for one request; context [T] (or [1, T]) committed token ids ending with the root.
        Returns a [1, N] DraftTree (N = 0 when nothing matches)."""
        ctx = np.asarray(context.reshape(-1).tolist() if isinstance(context, torch.Tensor) else list(context),
                         dtype=np.int64)
        device = context.device if isinstance(context, torch.Tensor) else "cpu"
        matches = self._matches(ctx)
        if not matches:
            return DraftTree.empty(1, device=device)
        tokens, parents, weights, root_weight = self._trie(ctx, matches)
        w = np.asarray(weights, dtype=np.float64)
        parent_w = np.where(np.asarray(parents) >= 0, w[np.maximum(parents, 0)], root_weight)
        q = w / (parent_w + self.config.smoothing)
        return DraftTree.from_parents(
            torch.tensor([tokens], dtype=torch.int64, device=device),
            torch.tensor([parents], dtype=torch.int64, device=device),
            torch.from_numpy(q[None].astype(np.float32)).to(device),
        )

    def _matches(self, ctx: np.ndarray) -> list[tuple[int, int]]:
        """(continuation start j, match length n), best first: longest n, then most recent j."""
        c = self.config
        T = ctx.shape[0]
        if T < c.min_ngram + 1:
            return []
        j = np.arange(1, T)  # continuation starts: x_j exists and j < T
        match_len = np.zeros(T - 1, dtype=np.int64)
        still = np.ones(T - 1, dtype=bool)
        for k in range(min(c.max_ngram, T - 1)):
            ok = (j - 1 - k) >= 0
            eq = np.zeros(T - 1, dtype=bool)
            eq[ok] = ctx[(j - 1 - k)[ok]] == ctx[T - 1 - k]
            still &= eq
            match_len[still] = k + 1
        keep = match_len >= c.min_ngram
        if not keep.any():
            return []
        js, ns = j[keep], match_len[keep]
        order = np.lexsort((-js, -ns))[: c.max_matches]
        return [(int(js[i]), int(ns[i])) for i in order]

    def _trie(self, ctx: np.ndarray, matches: list[tuple[int, int]]):
        """Merge continuations into a trie (parents before children, distinct siblings)."""
        c = self.config
        tokens: list[int] = []
        parents: list[int] = []
        weights: list[float] = []
        children: dict[tuple[int, int], int] = {}  # (parent idx, token) -> node idx
        root_weight = 0.0
        for start, n in matches:
            root_weight += n
            parent = -1
            for tok in ctx[start : start + c.max_depth].tolist():
                node = children.get((parent, tok))
                if node is None:
                    if len(tokens) >= c.max_nodes:
                        break
                    node = len(tokens)
                    children[(parent, tok)] = node
                    tokens.append(tok)
                    parents.append(parent)
                    weights.append(0.0)
                weights[node] += n
                parent = node
        return tokens, parents, weights, root_weight
