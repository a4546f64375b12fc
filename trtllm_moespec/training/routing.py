"""Routing traces of a Qwen3-MoE target through forward hooks on its routers.

The hook sits on ``model.model.layers[i].mlp.gate``: in transformers >= 5 a
``Qwen3MoeTopKRouter`` returning ``(router_logits, router_scores, router_indices)``,
in 4.57 a plain ``nn.Linear`` returning logits (we then take the top-K of the
softmax ourselves, exactly as the 4.57 block does). No model code is forked.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn


def moe_gates(model: nn.Module) -> list[nn.Module]:
    """The router module of every MoE layer, in layer order."""
    layers = model.model.layers
    gates = [layer.mlp.gate for layer in layers if hasattr(layer.mlp, "gate")]
    if len(gates) != len(layers):
        raise ValueError("routing traces need every decoder layer to be MoE (mlp_only_layers=[], decoder_sparse_step=1)")
    return gates


class RouterTrace:
    """Context manager recording the top-K expert ids of every routed token.

    After one forward of ``[B, T]`` tokens, ``topk_ids()`` is ``[B, T, L, K]`` int64.
    """

    def __init__(self, model: nn.Module):
        self.model = model
        self.topk = model.config.num_experts_per_tok
        self._records: list[list[torch.Tensor]] = [[] for _ in moe_gates(model)]
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    def __enter__(self) -> "RouterTrace":
        for layer_idx, gate in enumerate(moe_gates(self.model)):
            self._handles.append(gate.register_forward_hook(self._make_hook(layer_idx)))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _make_hook(self, layer_idx: int):
        def hook(module: nn.Module, inputs: tuple[torch.Tensor, ...], output: object) -> None:
            if isinstance(output, tuple):  # transformers >= 5: (logits, scores, indices)
                indices = output[2]
            else:  # transformers 4.57: logits only
                indices = torch.softmax(output.float(), dim=-1).topk(self.topk, dim=-1).indices
            self._records[layer_idx].append(indices.detach().reshape(-1, self.topk))

        return hook

    def clear(self) -> None:
        for rec in self._records:
            rec.clear()

    def topk_ids(self, batch_size: int) -> torch.Tensor:
        """[B, T, L, K] int64 experts of the tokens routed since the last ``clear``."""
        per_layer = [torch.cat(rec) for rec in self._records]  # L x [B*T, K]
        stacked = torch.stack(per_layer, dim=1).long()  # [B*T, L, K]
        return stacked.view(batch_size, -1, *stacked.shape[1:])


@torch.no_grad()
def capture_topk(model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """Top-K experts of every token of input_ids [B, T]: [B, T, L, K] int64 (sorted ids)."""
    with RouterTrace(model) as trace:
        model(input_ids=input_ids, use_cache=False)
        return trace.topk_ids(input_ids.shape[0]).sort(dim=-1).values


@dataclass(frozen=True)
class Utilisation:
    """How evenly the routed tokens spread over the experts."""

    fractions: torch.Tensor  # [L, E] float64 share of the routed (token, slot) pairs
    entropy_bits: torch.Tensor  # [L] float64 entropy of fractions; max log2(E)
    frac_below_1pct: torch.Tensor  # [L] float64 fraction of experts with < 1% of the tokens


def utilisation(topk_ids: torch.Tensor, num_experts: int) -> Utilisation:
    """Per-layer expert utilisation of topk_ids [..., L, K].

    "Share of the tokens" of an expert = tokens routed to it / number of tokens, so a
    perfectly even top-K router gives every expert K / E of the tokens.
    """
    flat = topk_ids.reshape(-1, *topk_ids.shape[-2:])  # [T, L, K]
    num_layers = flat.shape[1]
    counts = torch.stack([torch.bincount(flat[:, l].flatten(), minlength=num_experts) for l in range(num_layers)]).double()
    fractions = counts / counts.sum(-1, keepdim=True)
    entropy = -(fractions * fractions.clamp(min=1e-30).log2()).sum(-1)
    token_share = counts / flat.shape[0]
    return Utilisation(fractions, entropy, (token_share < 0.01).double().mean(-1))


def max_entropy_bits(num_experts: int) -> float:
    return math.log2(num_experts)
