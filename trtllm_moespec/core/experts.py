"""Expert sets as bitsets over (layer, expert) pairs.

Bit `layer * num_experts + expert` of a row is set when that expert of that MoE
layer is (predicted to be) activated. Words are int64, so unions are bitwise ORs
and set sizes are popcounts; 94 layers x 256 experts fit in 376 words.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

WORD_BITS = 64


def num_words(num_layers: int, num_experts: int) -> int:
    """Words needed for one (layer, expert) bitset."""
    return (num_layers * num_experts + WORD_BITS - 1) // WORD_BITS


@dataclass(frozen=True)
class ExpertSets:
    """Per-node expert sets of a batch of draft trees."""

    bits: torch.Tensor  # [B, N, W] int64 bitset words
    num_layers: int
    num_experts: int

    @staticmethod
    def from_topk_ids(topk_ids: torch.Tensor, num_experts: int) -> "ExpertSets":
        """topk_ids: [B, N, L, topk] int64 expert ids per node per MoE layer (-1 = none)."""
        if topk_ids.dim() != 4:
            raise ValueError(f"topk_ids must be [B, N, L, topk], got shape {tuple(topk_ids.shape)}")
        B, N, L, _ = topk_ids.shape
        # checked on the CPU only: on a device the read back is a sync, and the engine's ids come from
        # top-k over the router's num_experts columns
        if topk_ids.device.type == "cpu" and bool((topk_ids >= num_experts).any()):
            raise ValueError(f"expert id out of range: max {int(topk_ids.max())} >= num_experts {num_experts}")
        return ExpertSets(pack_expert_ids(topk_ids, num_experts), L, num_experts)

    def union(self, node_mask: torch.Tensor) -> torch.Tensor:
        """[B, W] union of the sets of nodes where node_mask [B, N] is True."""
        masked = torch.where(node_mask[:, :, None], self.bits, torch.zeros_like(self.bits))
        return or_reduce(masked, dim=1)


def pack_expert_ids(topk_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[..., L, topk] expert ids -> [..., W] int64 bitset words (ids < 0 are ignored)."""
    *lead, L, topk = topk_ids.shape
    W = num_words(L, num_experts)
    flat = topk_ids.reshape(-1, L, topk).long()
    bit = flat + torch.arange(L, device=flat.device)[None, :, None] * num_experts  # [M, L, topk]
    valid = flat >= 0
    # Invalid ids go to a spare column past the last word, dropped afterwards.
    cols = torch.where(valid, bit, W * WORD_BITS).reshape(flat.shape[0], L * topk)
    bits = torch.zeros(flat.shape[0], W * WORD_BITS + 1, dtype=torch.bool, device=flat.device)
    bits.scatter_(1, cols, True)
    bits = bits[:, : W * WORD_BITS]
    return bools_to_words(bits).reshape(*lead, W)


def bools_to_words(bits: torch.Tensor) -> torch.Tensor:
    """[..., W*64] bool -> [..., W] int64 (bit j of word w = element w*64 + j)."""
    *lead, nbits = bits.shape
    shifts = torch.arange(WORD_BITS, device=bits.device, dtype=torch.int64)
    words = (bits.reshape(*lead, nbits // WORD_BITS, WORD_BITS).long() << shifts).sum(-1)
    return words


def words_to_bools(words: torch.Tensor) -> torch.Tensor:
    """[..., W] int64 -> [..., W*64] bool."""
    shifts = torch.arange(WORD_BITS, device=words.device, dtype=torch.int64)
    return ((words[..., None] >> shifts) & 1).bool().flatten(-2)


def or_reduce(words: torch.Tensor, dim: int) -> torch.Tensor:
    """Bitwise OR over one dimension."""
    if words.device.type == "cpu":
        arr = words.contiguous().numpy()
        return torch.from_numpy(np.bitwise_or.reduce(arr, axis=dim) if arr.shape[dim] else np.zeros(
            arr.shape[:dim] + arr.shape[dim + 1 :], dtype=arr.dtype))
    shape = list(words.shape)
    del shape[dim]
    out = torch.zeros(shape, dtype=words.dtype, device=words.device)
    for i in range(words.shape[dim]):
        out |= words.select(dim, i)
    return out


def popcount(words: torch.Tensor) -> torch.Tensor:
    """Number of set bits over the last (word) dimension, int64."""
    arr = words.detach().cpu().contiguous().numpy().view(np.uint64)
    counts = np.bitwise_count(arr).sum(-1, dtype=np.int64)
    return torch.from_numpy(np.asarray(counts)).to(words.device)


def unique_experts_per_layer(words: torch.Tensor, num_layers: int, num_experts: int) -> torch.Tensor:
    """[..., L] number of distinct experts per layer in a bitset [..., W]."""
    return words_to_bools(words)[..., : num_layers * num_experts].reshape(*words.shape[:-1], num_layers, num_experts).sum(-1)
