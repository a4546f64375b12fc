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
is reused, not re-implemented; for the lean forward (models/moe.py) the local experts
run through its own `routed_experts`.
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace
from typing import Callable

import torch
from torch import nn

from ..models.moe import ExpertWeights, gpt_oss_weights, qwen3_moe_weights, routed_experts

ReduceFn = Callable[[torch.Tensor], None]  # in-place sum over the EP ranks


ComputeFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # (x [S, H], ids [S, 1], w [S, 1]) -> [S, H]


def combine_slots(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                  local_index: torch.Tensor, compute: ComputeFn, reduce: ReduceFn) -> torch.Tensor:
    """One MoE layer's routed-expert output [T, H] under EP: this rank computes the (token, slot)
    pairs whose expert it holds (`local_index` [E]: local id or -1), all ranks all-reduce the slot
    outputs, then every rank sums each token's k slots as the unsharded layer does."""
    T, k = top_k_index.shape  # hidden_states [T, H], top_k_weights [T, k]
    local = local_index[top_k_index.reshape(-1)]  # [T*k] local id of each (token, slot)'s expert, -1 elsewhere
    rows = torch.nonzero(local >= 0).squeeze(1)  # [S_local] flat (token, slot) rows this rank computes
    slots = hidden_states.new_zeros(T * k, hidden_states.shape[-1])  # [T*k, H]
    if rows.numel():
        slots[rows] = compute(hidden_states[rows // k], local[rows, None], top_k_weights.reshape(-1)[rows, None])
    reduce(slots)
    return slots.view(T, k, -1).sum(dim=1)  # same reduction, same order as the unsharded layer


def local_index_of(local_ids: tuple[int, ...], num_experts: int, device) -> torch.Tensor:
    """[E] int64: the local id of each global expert on this rank, -1 where another rank holds it."""
    index = torch.full((num_experts,), -1, dtype=torch.int64)
    index[torch.tensor(local_ids, dtype=torch.int64)] = torch.arange(len(local_ids))
    return index.to(device)


class ShardedExperts(nn.Module):
    """The experts of one MoE layer held by this rank, combined across ranks by `reduce`
    (replaces transformers' experts module; the lean forward gets a `LeanShard` instead)."""

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
        self.num_experts = num_experts  # global count, as the module it replaces
        self.register_buffer("local_index", local_index_of(local_ids, num_experts, experts_device(experts)),
                             persistent=False)
        self.num_calls = 0  # forwards through this shard (tests check the sharded path really runs)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        self.num_calls += 1
        return combine_slots(hidden_states, top_k_index, top_k_weights, self.local_index, self.inner, self.reduce)


class LeanShard:
    """This rank's experts of one MoE layer for the lean forward (`models/moe.py`): the local
    experts run through its own `routed_experts`, combined across ranks as ShardedExperts."""

    def __init__(self, local: ExpertWeights, local_index: torch.Tensor, reduce: ReduceFn):
        self.local, self.local_index, self.reduce = local, local_index, reduce
        self.num_calls = 0

    def __call__(self, x: torch.Tensor, top_ids: torch.Tensor, top_w: torch.Tensor) -> torch.Tensor:
        self.num_calls += 1
        return combine_slots(x, top_ids, top_w, self.local_index,
                             lambda xs, ids, w: routed_experts(xs, ids, w, self.local), self.reduce)


def experts_device(experts: nn.Module) -> torch.device:
    return next(experts.parameters()).device


def shard_target_experts(model: nn.Module, experts_paths: list[str], local_ids_per_layer: list[tuple[int, ...]],
                         reduce: ReduceFn) -> list[ShardedExperts]:
    """Replace each MoE layer's experts module (at `experts_paths`) by this rank's `ShardedExperts`."""
    shards = []
    for path, local_ids in zip(experts_paths, local_ids_per_layer):
        parent_path, _, name = path.rpartition(".")
        parent = model.get_submodule(parent_path)
        shards.append(ShardedExperts(getattr(parent, name), local_ids, reduce))
        setattr(parent, name, shards[-1])
    return shards


def shard_lean_layers(lean, model: nn.Module, moe_layers: tuple[int, ...], shards: list[ShardedExperts],
                      reduce: ReduceFn) -> None:
    """Point the lean forward's MoE layers at this rank's experts (the sliced transformers weights,
    laid out by the lean forward's own weight readers, so strides match one process)."""
    for i, shard in zip(moe_layers, shards):
        mlp = model.model.layers[i].mlp
        if hasattr(mlp, "router"):
            _, local = gpt_oss_weights(SimpleNamespace(router=mlp.router, experts=shard.inner))
        else:
            _, local = qwen3_moe_weights(SimpleNamespace(gate=mlp.gate, experts=shard.inner))
        module = LeanShard(local, shard.local_index, reduce)
        lean.layers[i] = replace(lean.layers[i], experts=ExpertWeights(None, None, None, None, None, module,
                                                                        shard.num_experts))
