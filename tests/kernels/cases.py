"""Random select_tree inputs for the kernel tests (numpy-generated, seeded).

Scores come in two flavours: a grid (products of q in {1/8, ..., 8/8}, exact in
float32 and float64, so exact ties are frequent and test the lowest-index rule)
and free float32 values. Both give bit-identical float64 keys in every
implementation, so selected sets and orders must be equal exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from trtllm_moespec.core.experts import pack_expert_ids
from trtllm_moespec.core.policies import Selection

MODES = ("evict", "ecospec", "ecospec_global", "joint")


@dataclass(frozen=True)
class SelectCase:
    scores: torch.Tensor  # [B, N] float32
    parents: torch.Tensor  # [B, N] int64
    valid: torch.Tensor  # [B, N] bool
    depth: torch.Tensor  # [B, N] int64
    node_bits: torch.Tensor  # [B, N, W] int64
    root_bits: torch.Tensor  # [B, W] int64
    cost_table: torch.Tensor  # [K+1] float64
    budget: int
    c0: float
    c_tok: float
    c_exp: float
    eps: float

    def args(self) -> tuple:
        return (self.scores, self.parents, self.valid, self.depth, self.node_bits, self.root_bits, self.cost_table)

    def kwargs(self) -> dict:
        return dict(budget=self.budget, c0=self.c0, c_tok=self.c_tok, c_exp=self.c_exp, eps=self.eps)


def random_case(seed: int, batch: int, num_nodes: int, layers: int = 3, experts: int = 16, topk: int = 2,
                grid: bool = True, max_k: int | None = None, budget: int | None = None) -> SelectCase:
    rng = np.random.default_rng(seed)
    B, N = batch, num_nodes
    parents = np.full((B, N), -1, dtype=np.int64)
    valid = np.zeros((B, N), dtype=bool)
    depth = np.zeros((B, N), dtype=np.int64)
    scores = np.zeros((B, N), dtype=np.float64)
    for b in range(B):
        n_valid = int(rng.integers(0, N + 1)) if rng.random() < 0.7 else N
        for i in range(n_valid):
            p = int(rng.integers(-1, i)) if i else -1
            q = rng.integers(1, 9) / 8.0 if grid else rng.uniform(0.01, 1.0)
            parents[b, i] = p
            valid[b, i] = True
            depth[b, i] = 1 if p < 0 else depth[b, p] + 1
            scores[b, i] = q if p < 0 else q * scores[b, p]
    pool = max(topk, experts // 3)  # concentrated routing: overlaps between nodes are common
    ids = rng.integers(0, pool, size=(B, N, layers, topk))
    node_bits = pack_expert_ids(torch.from_numpy(ids), experts)
    root_ids = torch.from_numpy(rng.integers(-1, pool, size=(B, layers, topk)))
    root_bits = pack_expert_ids(root_ids, experts) if rng.random() < 0.7 else torch.zeros(B, node_bits.shape[2],
                                                                                          dtype=torch.int64)
    K = int(rng.integers(0, N + 3)) if max_k is None else max_k
    cost_table = torch.from_numpy(np.cumsum(rng.integers(1, 6, size=K + 1)) / 8.0 + rng.integers(0, 2, K + 1) / 16)
    return SelectCase(
        scores=torch.from_numpy(scores).float(), parents=torch.from_numpy(parents), valid=torch.from_numpy(valid),
        depth=torch.from_numpy(depth), node_bits=node_bits, root_bits=root_bits, cost_table=cost_table.double(),
        budget=int(rng.integers(1, N + 3)) if budget is None else budget,
        c0=float(rng.integers(8, 64)) / 8.0, c_tok=float(rng.integers(0, 16)) / 64.0,
        c_exp=float(rng.integers(0, 16)) / 256.0, eps=1e-3 if rng.random() < 0.5 else 0.125,
    )


def assert_same_selection(ref: Selection, out: Selection, what: str = "") -> None:
    """Exact node lists and counts; expected tokens to 1e-12; costs exact (NaN == NaN)."""
    assert torch.equal(out.node_idx.cpu(), ref.node_idx), f"{what}: node_idx\n{ref.node_idx}\n{out.node_idx}"
    assert torch.equal(out.num_selected.cpu(), ref.num_selected), f"{what}: num_selected"
    torch.testing.assert_close(out.expected_tokens.cpu(), ref.expected_tokens, rtol=1e-12, atol=1e-12, msg=what)
    torch.testing.assert_close(out.predicted_cost.cpu(), ref.predicted_cost, rtol=0, atol=0, equal_nan=True, msg=what)
