"""Expert placement under expert parallelism (EP), and the cost it implies.

With EP over N ranks every MoE layer's experts are split across the ranks and a
verify forward waits for the slowest rank: the rank whose share of the activated
(layer, expert) pairs is largest. So the expert term of a step's cost follows the
busiest rank's union

    U_max = max_r |U ∩ R_r|,   R_r = the (layer, expert) pairs rank r holds,

not the global union |U|. Two trees with the same 20 unique experts cost differently
if one puts 12 of them on one rank.

`ExpertPlacement` says which rank holds each (layer, expert). The default is
contiguous blocks, rank r holding experts [r*E/N, (r+1)*E/N) of every layer, as
TensorRT-LLM's fused MoE does without a load balancer (`initial_global_assignments`
= `ep_rank * num_experts // ep_size + local_slot_id`, `slot_start = ep_rank *
expert_size_per_partition`: tensorrt_llm/_torch/modules/fused_moe/fused_moe_trtllm_gen.py
at NVIDIA/TensorRT-LLM 7b437aaa73bf5a44b1102aee5c631074da763b8f).

Rank masks are bitsets over (layer, expert) in the layout of `experts.py`, so the
busiest rank's union of any bitset is N popcounts of an AND.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from .experts import WORD_BITS, bools_to_words, num_words


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

    def rank_masks(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """[N, W] int64 bitsets: bit (layer * E + expert) of row r is set when rank r holds it."""
        return self._masks_cpu.to(device)

    @cached_property
    def _masks_cpu(self) -> torch.Tensor:  # built once per placement: selection asks every step
        owner = torch.tensor(self.owner, dtype=torch.int64)  # [L, E]
        W = num_words(self.num_layers, self.num_experts)
        flat = owner.reshape(-1)
        bits = torch.zeros(self.num_ranks, W * WORD_BITS, dtype=torch.bool)
        bits[flat, torch.arange(flat.numel())] = True
        return bools_to_words(bits)


def check_divides(num_experts: int, num_ranks: int) -> None:
    """ValueError unless `num_ranks` splits `num_experts` into equal contiguous blocks."""
    if not isinstance(num_ranks, int) or num_ranks < 1:
        raise ValueError(f"--ep must be a positive integer, got {num_ranks!r}")
    if num_experts % num_ranks:
        raise ValueError(f"--ep {num_ranks} does not divide the model's {num_experts} experts per layer")


def unique_per_rank(words: torch.Tensor, rank_masks: torch.Tensor) -> torch.Tensor:
    """[..., N] int64 |U ∩ R_r| for bitsets `words` [..., W] and rank masks [N, W]."""
    a = words.detach().cpu().contiguous().numpy().view(np.uint64)
    m = rank_masks.detach().cpu().contiguous().numpy().view(np.uint64)
    counts = np.bitwise_count(a[..., None, :] & m).sum(-1, dtype=np.int64)  # [..., N]
    return torch.from_numpy(np.asarray(counts)).to(words.device)


def busiest_rank_unique(words: torch.Tensor, rank_masks: torch.Tensor) -> torch.Tensor:
    """[...] int64 U_max = max_r |U ∩ R_r|: the expert term of a step's cost under EP."""
    return unique_per_rank(words, rank_masks).max(-1).values


def busiest_np(words: np.ndarray, masks: np.ndarray) -> np.ndarray:
    """numpy form of `busiest_rank_unique` on uint64 words [..., W] and masks [N, W]."""
    return np.bitwise_count(words[..., None, :] & masks).sum(-1).max(-1)


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
