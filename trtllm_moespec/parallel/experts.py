"""Expert-parallel MoE layers on the transformers-loaded target.

Each rank keeps only its share of every MoE layer's expert weights (the placement's
`local_experts`); routers, attention, dense layers and embeddings stay replicated, so
every rank routes every token identically. A sharded experts module computes the
(token, top-k slot) pairs whose expert it holds and all-reduces the slot outputs;
every rank then sums each token's k slots itself.

Why slots and not partial sums: transformers' `grouped_mm` / `batched_mm` experts end
with `weighted_out.view(T, k, H).sum(dim=1)`. All-reducing [T, k, H] slot outputs, each
non-zero on exactly one rank, is exact (x + 0 = x), and the final sum over k then runs
in the same order as in one process, so logits are bitwise equal to one process
(tests pin it). All-reducing [T, H] partial sums would move k times less data but
reorder the floating-point sum: greedy output could then drift from one process.
The local computation calls the module's own experts implementation on the local
weights (one slot per row, top-1), so any implementation transformers dispatches to
is reused, not re-implemented.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

ReduceFn = Callable[[torch.Tensor], None]  # in-place sum over the EP ranks


class ShardedExperts(nn.Module):
    """The experts of one MoE layer held by this rank, combined across ranks by `reduce`."""

    def __init__(self, experts: nn.Module, local_ids: tuple[int, ...], reduce: ReduceFn):
        super().__init__()
        num_experts = experts.num_experts
        if not local_ids:
            raise ValueError("every EP rank needs at least one expert per layer")
        keep = torch.tensor(local_ids, dtype=torch.int64)
        for name, param in list(experts.named_parameters(recurse=False)):
            if param.shape[0] != num_experts:
                raise ValueError(f"experts parameter {name} of shape {tuple(param.shape)} is not stacked per expert")
            # A fresh tensor, so the full stack is freed once the model drops it.
            setattr(experts, name, nn.Parameter(param.data.index_select(0, keep.to(param.device)).clone(),
                                                requires_grad=False))
        experts.num_experts = len(local_ids)
        self.inner = experts
        self.reduce = reduce
        local_index = torch.full((num_experts,), -1, dtype=torch.int64)
        local_index[keep] = torch.arange(len(local_ids))
        self.register_buffer("local_index", local_index.to(experts_device(experts)), persistent=False)
        self.num_calls = 0  # forwards through this shard (tests check the sharded path really runs)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        T, k = top_k_index.shape  # hidden_states [T, H], top_k_weights [T, k]
        self.num_calls += 1
        local = self.local_index[top_k_index.reshape(-1)]  # [T*k] local slot of each (token, slot)'s expert, -1 elsewhere
        rows = torch.nonzero(local >= 0).squeeze(1)  # [S_local] flat (token, slot) rows this rank computes
        slots = hidden_states.new_zeros(T * k, hidden_states.shape[-1])  # [T*k, H]
        if rows.numel():
            slots[rows] = self.inner(hidden_states[rows // k], local[rows, None], top_k_weights.reshape(-1)[rows, None])
        self.reduce(slots)
        return slots.view(T, k, -1).sum(dim=1)  # same reduction, same order as the unsharded module


def experts_device(experts: nn.Module) -> torch.device:
    return next(experts.parameters()).device


def shard_target_experts(model: nn.Module, experts_paths: list[str], local_ids_per_layer: list[tuple[int, ...]],
                         reduce: ReduceFn) -> None:
    """Replace each MoE layer's experts module (at `experts_paths`) by this rank's `ShardedExperts`."""
    for path, local_ids in zip(experts_paths, local_ids_per_layer):
        parent_path, _, name = path.rpartition(".")
        parent = model.get_submodule(parent_path)
        setattr(parent, name, ShardedExperts(getattr(parent, name), local_ids, reduce))
