"""Does every layer and every expert of a trained target change its output?

A model that reaches a cost regime by padding (layers or experts that do nothing but cost time)
would show layers whose removal leaves the loss unchanged, or experts that no token reaches or
whose removal changes nothing. This measures both on held-out windows:

- layer ablation: the decoder layer replaced by the identity (its residual contribution dropped);
- expert ablation: the expert's output zeroed (its ``down_proj`` set to zero), the router unchanged,
  so the tokens routed to it lose its contribution.

Reported as the held-out loss increase of each ablation (nats/token) and, per expert, the share of
routed (token, slot) pairs it receives. A rarely routed expert may receive none of a few ablation windows'
tokens; `ablate_where_routed` zeroes each expert on the held-out window that routes most tokens to it.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class AblationReport:
    """Loss increases of removing each layer / expert, on the same windows."""

    base_loss: float  # nats/token, nothing removed
    layer_delta: list[float]  # [L] loss increase with layer l replaced by the identity
    expert_delta: list[list[float]]  # [L][E] loss increase with expert e of layer l zeroed
    expert_share: list[list[float]]  # [L][E] share of routed (token, slot) pairs that go to expert e

    def summary(self) -> dict:
        flat = [d for row in self.expert_delta for d in row]
        shares = [s for row in self.expert_share for s in row]
        return {"base_loss": self.base_loss, "min_layer_delta": min(self.layer_delta),
                "min_expert_delta": min(flat), "median_expert_delta": sorted(flat)[len(flat) // 2],
                "experts_changing_loss": sum(d != 0 for d in flat), "num_experts": len(flat),
                "min_expert_share": min(shares)}


@torch.no_grad()
def _loss(model: torch.nn.Module, windows: torch.Tensor) -> float:
    logits = model(input_ids=windows[:, :-1], use_cache=False).logits
    return F.cross_entropy(logits.float().flatten(0, 1), windows[:, 1:].flatten()).item()


@contextmanager
def skip_layer(model: torch.nn.Module, index: int):
    """Layer ``index`` returns its input unchanged (a forward hook replacing its output)."""
    layer = model.model.layers[index]

    def identity(module, args, kwargs, output):
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        return (hidden, *output[1:]) if isinstance(output, tuple) else hidden

    handle = layer.register_forward_hook(identity, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


@contextmanager
def _zero_expert(model: torch.nn.Module, layer: int, expert: int):
    down = model.model.layers[layer].mlp.experts.down_proj
    saved = down[expert].clone()
    down[expert].zero_()
    try:
        yield
    finally:
        down[expert].copy_(saved)


@torch.no_grad()
def routed_counts(model: torch.nn.Module, windows: torch.Tensor, batch_size: int = 8) -> torch.Tensor:
    """[W, L, E] routed (token, slot) pairs per window, layer and expert (the router's top-k)."""
    from .routing import RouterTrace

    num_experts, counts = model.config.num_experts, []
    for chunk in windows.split(batch_size):
        with RouterTrace(model) as trace:
            model(input_ids=chunk[:, :-1], use_cache=False)
            topk = trace.topk_ids(chunk.shape[0])  # [w, S, L, K]
        counts.append(F.one_hot(topk, num_experts).sum(dim=(1, 3)))  # [w, L, E]
    return torch.cat(counts)


def expert_shares(model: torch.nn.Module, windows: torch.Tensor) -> list[list[float]]:
    """[L][E] share of routed (token, slot) pairs per expert (router top-k over the windows)."""
    counts = routed_counts(model, windows).sum(0)  # [L, E]
    return (counts.double() / counts.sum(-1, keepdim=True)).tolist()


@dataclass(frozen=True)
class WhereRouted:
    """One expert zeroed on the window that routes most tokens to it."""

    layer: int
    expert: int
    window: int  # index into the windows
    window_pairs: int  # (token, slot) pairs that window routes to the expert
    total_pairs: int  # over all windows
    loss_delta: float  # nats/token on that window
    top1_changed: int  # positions of that window whose top-1 prediction changes
    # the largest change of any logit on that window: what "changes the output" reads (a window's mean loss can
    # come back to the same float32 value while single tokens' losses move by 0.1 both ways)
    logit_change: float = 0.0


@torch.no_grad()
def ablate_where_routed(model: torch.nn.Module, windows: torch.Tensor, progress: bool = True) -> list[WhereRouted]:
    """Every expert zeroed in turn on the window [1, S + 1] of ``windows`` that routes most tokens to it."""
    from tqdm import tqdm

    model.eval()
    counts = routed_counts(model, windows)  # [W, L, E]
    best = counts.argmax(0)  # [L, E]

    def loss_and_logits(w: int) -> tuple[float, torch.Tensor]:
        logits = model(input_ids=windows[w:w + 1, :-1], use_cache=False).logits[0].float()  # [S, V]
        return F.cross_entropy(logits, windows[w, 1:]).item(), logits

    num_layers, num_experts = best.shape
    # window by window, so one window's intact logits ([S, V]) are kept at a time, not one per window used
    pairs = sorted(((l, e) for l in range(num_layers) for e in range(num_experts)), key=lambda p: int(best[p]))
    rows, w_intact, intact = [], None, None
    for l, e in tqdm(pairs, desc="experts where routed", disable=not progress, mininterval=10):
        w = int(best[l, e])
        if w != w_intact:
            w_intact, intact = w, loss_and_logits(w)
        with _zero_expert(model, l, e):
            loss, logits = loss_and_logits(w)
        base_loss, base = intact
        rows.append(WhereRouted(l, e, w, int(counts[w, l, e]), int(counts[:, l, e].sum()), loss - base_loss,
                                int((logits.argmax(-1) != base.argmax(-1)).sum()), float((logits - base).abs().max())))
    rows.sort(key=lambda r: (r.layer, r.expert))
    return rows


@torch.no_grad()
def ablate(model: torch.nn.Module, windows: torch.Tensor, progress: bool = True) -> AblationReport:
    """Every layer and every expert of ``model`` removed in turn on ``windows`` [W, S + 1]."""
    from tqdm import tqdm

    model.eval()
    base = _loss(model, windows)
    num_layers, num_experts = model.config.num_hidden_layers, model.config.num_experts
    bar = tqdm(total=num_layers * (1 + num_experts), desc="ablations", disable=not progress, mininterval=10)
    layer_delta, expert_delta = [], []
    for l in range(num_layers):
        with skip_layer(model, l):
            layer_delta.append(_loss(model, windows) - base)
        bar.update()
        row = []
        for e in range(num_experts):
            with _zero_expert(model, l, e):
                row.append(_loss(model, windows) - base)
            bar.update()
        expert_delta.append(row)
    bar.close()
    return AblationReport(base, layer_delta, expert_delta, expert_shares(model, windows))
