"""Drafting that pays for itself: whether to speculate at all, and when to stop drafting.

Both rules are EVICT's utility (expected committed tokens per second of step) applied
to decisions the selection policies never see:

- `speculation_pays`: k = 0 as a candidate *before* drafting. A plain step commits
  exactly one token for `plain_step_s`; a speculative step commits `expected_tokens`
  for `spec_step_s` (drafting included). Speculate only when tokens/s is higher.
- `expand_pays`: between drafter forwards. Another forward costs `draft_forward_s`
  and adds, at most, the frontier's value: at temperature 0 at most one child of a
  node is accepted, so the expected accepted children of v are <= value(v). We expect
  a level to keep the share `continuation` of the level before it (the tree's own ratio
  of its last two levels' values), so the next level adds G * continuation, the one
  after G * continuation^2, and so on. Expand when some number j of further forwards,
  up to those left, beats the best rate the tree already offers (max_k (1 + S_k) / C(k),
  with C(k) credited for the forwards not run): (1 + S + gains of j levels) over the
  cost of j forwards plus verifying the new nodes. Looking j levels ahead matters on
  MoE targets: verifying the first node costs far more than each next one (C(1) - C(0)
  is several times C(2) - C(1): one token wakes experts a second one mostly shares), so
  one level alone may not pay where a chain of levels does. The extra nodes per level
  are counted as the frontier's effective number, G / max value (about one when one
  child dominates): charging every frontier node's verification would stop drafting
  at depth 1 even when a single likely chain would pay.
- `DraftStopRule`: `expand_pays` packaged as the callable the EAGLE-3 drafting loop
  consults (`models/eagle3_draft.py`).

Node values are a [B, N] tensor of estimated acceptance probabilities; anything that
maps a DraftTree to one plugs in (`values=`), raw path scores by default. These rules
only change what is drafted and whether a step drafts at all; verification decides
what is emitted, so output stays lossless.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from .tree import DraftTree

NodeValues = Callable[[DraftTree], torch.Tensor]  # tree -> [B, N] estimated acceptance of each node


def raw_values(tree: DraftTree) -> torch.Tensor:
    """[B, N] the draft path scores (the ablation; invalid nodes 0)."""
    return torch.where(tree.valid, tree.scores, 0.0)


@dataclass(frozen=True)
class DraftingCosts:
    """Profiled costs of the pieces a step can skip (seconds)."""

    plain_step_s: float  # a plain decoding step: target forward of the root alone, no drafting
    draft_forward_s: float  # one drafter forward over the frontier while drafting a tree

    def __post_init__(self) -> None:
        for name in ("plain_step_s", "draft_forward_s"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"DraftingCosts.{name} must be a positive number of seconds, got {v!r}")


def speculation_pays(expected_tokens: float, spec_step_s: float, plain_step_s: float, margin: float = 0.0) -> bool:
    """True when a speculative step's tokens/s beats plain decoding's by more than `margin` (a fraction)."""
    if spec_step_s <= 0 or plain_step_s <= 0:
        raise ValueError(f"step costs must be positive, got spec {spec_step_s} and plain {plain_step_s}")
    return expected_tokens / spec_step_s > (1.0 + margin) / plain_step_s


def expand_pays(sorted_values: torch.Tensor, frontier_values: torch.Tensor, cost_table: torch.Tensor,
                forwards_left: int, draft_forward_s: float, continuation: torch.Tensor | float = 1.0) -> torch.Tensor:
    """[B] bool: are more drafter forwards worth their cost?

    sorted_values: [B, N] node values of the tree so far, descending (invalid = 0);
    frontier_values: [B, F] values of the nodes the next forward would expand (invalid = 0);
    cost_table: [K+1] C(k) seconds of a full speculative step (all drafter forwards run);
    forwards_left: drafter forwards C(k) counts that have not run yet (this one included);
    continuation: [B] (or one number) the share of a level's value the level below it is expected
    to keep, in [0, 1]; with 1 the deeper levels are worth the frontier's value each (the bound).
    """
    vals = sorted_values.detach().cpu().double().numpy()
    front = frontier_values.detach().cpu().double().numpy()
    table = cost_table.detach().cpu().double().numpy()
    q = np.broadcast_to(np.asarray(torch.as_tensor(continuation).cpu(), dtype=np.float64), vals.shape[:1])
    return torch.from_numpy(_expand_pays_host(vals, front, table, forwards_left, draft_forward_s, q))


def _expand_pays_host(vals: np.ndarray, front: np.ndarray, table: np.ndarray, forwards_left: int,
                      draft_forward_s: float, continuation: np.ndarray) -> np.ndarray:
    """`expand_pays` on float64 numpy arrays (the same shapes, continuation [B]) -> [B] bool."""
    K = table.shape[0] - 1
    # Step cost if drafting stopped now: the forwards not run are not paid (floor: a tiny positive cost).
    now = np.maximum(table - forwards_left * draft_forward_s, 1e-9)  # [K+1]
    B, N = vals.shape
    cu = np.concatenate([np.zeros((B, 1)), np.cumsum(vals[:, :K], 1)], 1)  # [B, min(N, K)+1]
    n = cu.shape[1]
    utility = (1.0 + cu) / now[None, :n]
    k_star = utility.argmax(1)
    rows = np.arange(B)
    best_rate = utility[rows, k_star]
    gain = front.sum(1)  # [B] the next level's value, at most
    effective = np.maximum(np.round(gain / np.maximum(front.max(1, initial=0.0), 1e-12)), 1).astype(np.int64)
    j = np.arange(1, max(forwards_left, 1) + 1)  # [J] further forwards
    q = np.clip(continuation, 0.0, 1.0)[:, None]
    gains = gain[:, None] * np.cumsum(q ** (j[None, :] - 1), 1)  # [B, J] value of j more levels
    k_next = np.minimum(k_star[:, None] + effective[:, None] * j[None, :], K)  # [B, J]
    next_cost = now[k_next] + j[None, :] * draft_forward_s
    rate = (1.0 + cu[rows, k_star][:, None] + gains) / next_cost
    return (rate.max(1) > best_rate) & (gain > 0)


def level_continuation(values: np.ndarray, depth: np.ndarray, frontier_depth: int) -> np.ndarray:
    """[B] the tree's last two levels' value ratio: sum of values at `frontier_depth` over the sum one
    level up (the root, worth 1, above depth 1), clipped to [0, 1]; what a level below is expected to keep."""
    last = np.where(depth == frontier_depth, values, 0.0).sum(1)
    above = np.where(depth == frontier_depth - 1, values, 0.0).sum(1) if frontier_depth > 1 else np.ones(len(values))
    return np.clip(last / np.maximum(above, 1e-12), 0.0, 1.0)


@dataclass(frozen=True)
class DraftStopRule:
    """Stop drafting when no number of further forwards can pay for itself (`expand_pays` per request,
    each level expected to keep the tree's own `level_continuation`).

    Called by the drafting loop before each forward after the first level:
    `rule(tree, frontier, num_forwards)` with frontier [B, F] node indices (-1 pad) -> [B] bool stop.
    """

    cost_table: tuple[float, ...]  # C(k), k = 0..K, of a full step (steps - 1 drafter forwards)
    draft_forward_s: float
    steps: int  # drafting steps the table was measured with (steps - 1 forwards after the root)
    values: NodeValues = raw_values

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        if not (math.isfinite(self.draft_forward_s) and self.draft_forward_s > 0):
            raise ValueError(f"draft_forward_s must be positive, got {self.draft_forward_s}")
        object.__setattr__(self, "_table", np.asarray(self.cost_table, dtype=np.float64))  # frozen: set once here

    def __call__(self, tree: DraftTree, frontier: torch.Tensor, num_forwards: int) -> torch.Tensor:
        # Called before every drafter forward: after the values, the small sort/gather/utility work runs
        # in numpy on float64 copies (what expand_pays computes in; float32 -> float64 is exact, so
        # sorting before or after the conversion gives the same array). ~10x fewer microseconds.
        values = torch.where(tree.valid, self.values(tree), 0.0).detach().cpu().double().numpy()  # [B, N]
        sorted_values = -np.sort(-values, axis=1)  # descending
        fr = frontier.detach().cpu().numpy()
        frontier_values = np.where(fr >= 0, np.take_along_axis(values, np.maximum(fr, 0), axis=1), 0.0)  # [B, F]
        forwards_left = max(self.steps - 1 - num_forwards, 1)
        continuation = level_continuation(values, tree.depth.detach().cpu().numpy(), num_forwards + 1)
        return torch.from_numpy(~_expand_pays_host(sorted_values, frontier_values, self._table, forwards_left,
                                                   self.draft_forward_s, continuation))
