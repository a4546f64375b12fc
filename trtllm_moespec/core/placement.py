"""Expert placement under expert parallelism (EP), and the cost it implies.

With EP over N ranks every MoE layer's experts are split across the ranks, and each
MoE layer ends in a collective that combines the ranks' partial outputs, so every
layer waits for its slowest rank: the rank computing the most distinct experts of
that layer. The expert term of a step's cost therefore follows

    U_max = sum over MoE layers l of max_r |U_l ∩ R_r|

(U_l = the activated experts of layer l, R_r = the experts rank r holds), not the
global union |U| = sum_l |U_l|. Two trees with the same 20 unique experts cost
differently if one puts 12 of them on one rank. With N = 1, U_max = |U|.

`ExpertPlacement` says which rank holds each (layer, expert). The default is
contiguous blocks, rank r holding experts [r*E/N, (r+1)*E/N) of every layer, as
TensorRT-LLM's fused MoE does without a load balancer (`initial_global_assignments`
= `ep_rank * num_experts // ep_size + local_slot_id`, `slot_start = ep_rank *
expert_size_per_partition`: tensorrt_llm/_torch/modules/fused_moe/fused_moe_trtllm_gen.py
at NVIDIA/TensorRT-LLM 7b437aaa73bf5a44b1102aee5c631074da763b8f).

Expert sets are the (layer, expert) bitsets of `experts.py`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch



@dataclass(frozen=True)
class ExpertPlacement:
    """Which EP rank holds each (MoE layer, expert) pair."""

    owner: tuple[tuple[int, ...], ...]  # [L][E] rank holding expert e of MoE layer l
    num_ranks: int

    def __post_init__(self) -> None:
        if not isinstance(self.num_ranks, int) or self.num_ranks < 1:
            raise ValueError(f"num_ranks must be a positive integer, got {self.num_ranks!r}")
        if not self.owner or not self.owner[0]:
            raise ValueError("placement needs at least one MoE layer and one expert")
        width = len(self.owner[0])
        for layer, row in enumerate(self.owner):
            if len(row) != width:
                raise ValueError(f"placement layer {layer} lists {len(row)} experts, layer 0 lists {width}")
            bad = [r for r in row if not 0 <= r < self.num_ranks]
            if bad:
                raise ValueError(f"placement layer {layer} names rank {bad[0]} outside 0..{self.num_ranks - 1}")

    @staticmethod
    def contiguous(num_layers: int, num_experts: int, num_ranks: int) -> "ExpertPlacement":
        """Rank r holds experts [r*E/N, (r+1)*E/N) of every layer (TensorRT-LLM's default)."""
        check_divides(num_experts, num_ranks)
        per_rank = num_experts // num_ranks
        row = tuple(e // per_rank for e in range(num_experts))
        return ExpertPlacement((row,) * num_layers, num_ranks)

    @property
    def num_layers(self) -> int:
        return len(self.owner)

    @property
    def num_experts(self) -> int:
        return len(self.owner[0])

    def local_experts(self, rank: int, layer: int = 0) -> tuple[int, ...]:
        """Expert ids of MoE layer `layer` that `rank` holds, ascending."""
        return tuple(e for e, r in enumerate(self.owner[layer]) if r == rank)

    def layer_rank_counts(self, words: torch.Tensor) -> torch.Tensor:
        """[..., L, N] int64 distinct experts of each MoE layer on each rank, for bitsets [..., W]."""
        arr = words.detach().cpu().contiguous().numpy().view(np.uint64)
        return torch.from_numpy(self.layer_rank_counts_np(arr)).to(words.device)

    def busiest_unique(self, words: torch.Tensor) -> torch.Tensor:
        """[...] int64 U_max = sum_l max_r |U_l ∩ R_r| for bitsets [..., W]: the expert term under EP."""
        return self.layer_rank_counts(words).max(-1).values.sum(-1)

    def layer_rank_counts_np(self, words: np.ndarray) -> np.ndarray:
        """numpy form of `layer_rank_counts` on uint64 words [..., W]."""
        L, E = self.num_layers, self.num_experts
        bits = np.unpackbits(np.ascontiguousarray(words).view(np.uint8), axis=-1, bitorder="little")
        bits = bits[..., : L * E].reshape(*words.shape[:-1], L, E)
        return np.einsum("...le,len->...ln", bits.astype(np.int64), self._owner_onehot)

    def busiest_np(self, words: np.ndarray) -> np.ndarray:
        """numpy form of `busiest_unique` on uint64 words [..., W]."""
        return self.layer_rank_counts_np(words).max(-1).sum(-1)

    @cached_property
    def _owner_onehot(self) -> np.ndarray:  # [L, E, N] int64, built once: selection asks every step
        owner = np.asarray(self.owner, dtype=np.int64)
        return (owner[..., None] == np.arange(self.num_ranks)).astype(np.int64)


def check_divides(num_experts: int, num_ranks: int) -> None:
    """ValueError unless `num_ranks` splits `num_experts` into equal contiguous blocks."""
    if not isinstance(num_ranks, int) or num_ranks < 1:
        raise ValueError(f"--ep must be a positive integer, got {num_ranks!r}")
    if num_experts % num_ranks:
        raise ValueError(f"--ep {num_ranks} does not divide the model's {num_experts} experts per layer")


def unique_per_rank_per_layer(expert_ids: torch.Tensor, placement: ExpertPlacement) -> torch.Tensor:
    """[N, L] distinct experts each rank computes per MoE layer, from router ids [T, L, topk]."""
    T, L, _ = expert_ids.shape
    if L != placement.num_layers:
        raise ValueError(f"router ids cover {L} MoE layers, the placement {placement.num_layers}")
    hit = torch.zeros(L, placement.num_experts, dtype=torch.bool)
    hit.scatter_(1, expert_ids.detach().cpu().permute(1, 0, 2).reshape(L, -1), True)
    owner = torch.tensor(placement.owner, dtype=torch.int64)  # [L, E]
    onehot = torch.nn.functional.one_hot(owner, placement.num_ranks).bool()  # [L, E, N]
    return (hit[:, :, None] & onehot).sum(1).T  # [N, L]
