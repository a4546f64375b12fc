"""The contract of `moespec::select_tree`, shared by every implementation.

One call covers all selection modes, batched over B requests:

  inputs   scores     [B, N] float32/64  path probabilities score(v) (0 for padding)
           parents    [B, N] int64/32    -1 = child of the root, parent idx < own idx
           valid      [B, N] bool
           depth      [B, N] int64/32    root children = 1 (consistent with parents)
           node_bits  [B, N, W] int64    PER-NODE (layer, expert) sets, not path sets
           root_bits  [B, W] int64       the root token's set (zeros when unknown)
           cost_table [K+1] float        C(k) seconds (evict only; may be empty otherwise)
  scalars  mode ("evict" | "ecospec" | "ecospec_global" | "joint"), budget >= 1,
           c0, c_tok, c_exp (joint), eps (ecospec, ecospec_global)
  outputs  node_idx [B, budget] int64 ordered (parent before child), -1 pad;
           num_selected [B] int64; expected_tokens [B] float64 = 1 + sum of selected
           scores; predicted_cost [B] float64 (NaN for ecospec*).

Modes, each equal to the core policy of the same name (core/policies.py):
  evict           nodes in score order (valid first, score desc, depth asc, index asc;
                  the op ranks the tree itself, callers pass nodes in any order),
                  k* = argmax_{0<=k<=min(budget, K, num_valid)} (1 + S_k) / C(k)
  ecospec         greedy by score / (eps + |E_path(v) \\ B|), B starts at root_bits, <= budget
  ecospec_global  as ecospec with a static cost |E_path(v)| (B stays empty, root ignored)
  joint           greedy by score / (token_cost + c_exp * new), stop at the utility peak
                  (1 + S_j) / (c0 + c_tok*j + c_exp*U_j); token_cost = joint_token_cost(c_tok, c_exp)

Evict ranks by the float scores, the policy by log-scores: the orders differ only
where two different log-scores round to the same float32 score.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import torch
from ..core.select import joint_token_cost  # noqa: F401  (re-exported)


class Mode(enum.IntEnum):
    """Integer ids used by the C ABI and the TensorRT plugin attribute."""

    EVICT = 0
    ECOSPEC = 1
    ECOSPEC_GLOBAL = 2
    JOINT = 3


MODE_NAMES = {m: m.name.lower() for m in Mode}
MODES_BY_NAME = {name: m for m, name in MODE_NAMES.items()}


def parse_mode(mode: str | int) -> Mode:
    """'evict' / 2 / Mode.JOINT -> Mode; anything else raises ValueError."""
    if isinstance(mode, str):
        if mode not in MODES_BY_NAME:
            raise ValueError(f"unknown select_tree mode {mode!r}; choose one of {sorted(MODES_BY_NAME)}")
        return MODES_BY_NAME[mode]
    try:
        return Mode(int(mode))
    except ValueError:
        raise ValueError(f"unknown select_tree mode id {mode!r}; choose one of {[int(m) for m in Mode]}") from None


@dataclass(frozen=True)
class GreedyCosts:
    """Scalars of the greedy key score / (token_cost + expert_cost * new)."""

    token_cost: float
    expert_cost: float
    marginal: bool  # False: static |E_path(v)| (ecospec_global)
    use_root: bool  # the buffer starts at root_bits


def greedy_costs(mode: Mode, c_tok: float, c_exp: float, eps: float) -> GreedyCosts:
    """Greedy scalars of a greedy mode (the same rule as the policies)."""
    if mode == Mode.ECOSPEC:
        return GreedyCosts(eps, 1.0, True, True)
    if mode == Mode.ECOSPEC_GLOBAL:
        return GreedyCosts(eps, 1.0, False, False)
    if mode == Mode.JOINT:
        return GreedyCosts(joint_token_cost(c_tok, c_exp), c_exp, True, True)
    raise ValueError(f"mode {mode.name.lower()} has no greedy stage")


@dataclass(frozen=True)
class SelectShapes:
    batch_size: int
    num_nodes: int
    num_words: int
    max_k: int  # K: cost table entries - 1 (evict), else -1


def check_inputs(
    scores: torch.Tensor, parents: torch.Tensor, valid: torch.Tensor, depth: torch.Tensor,
    node_bits: torch.Tensor, root_bits: torch.Tensor, cost_table: torch.Tensor,
    mode: Mode, budget: int, c0: float, c_tok: float, c_exp: float, eps: float,
) -> SelectShapes:
    """Shape, dtype and scalar checks (no data-dependent checks: safe under graph capture)."""
    if scores.dim() != 2:
        raise ValueError(f"scores must be [B, N], got shape {tuple(scores.shape)}")
    B, N = scores.shape
    if scores.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"scores must be float32 or float64, got {scores.dtype}")
    for name, t, dtypes in (("parents", parents, (torch.int64, torch.int32)), ("valid", valid, (torch.bool,)),
                            ("depth", depth, (torch.int64, torch.int32))):
        if tuple(t.shape) != (B, N):
            raise ValueError(f"{name} must be [B, N] = {(B, N)}, got {tuple(t.shape)}")
        if t.dtype not in dtypes:
            raise ValueError(f"{name} must have dtype in {dtypes}, got {t.dtype}")
    if node_bits.dim() != 3 or tuple(node_bits.shape[:2]) != (B, N) or node_bits.dtype != torch.int64:
        raise ValueError(f"node_bits must be int64 [B, N, W] with B, N = {(B, N)}, got {node_bits.dtype} "
                         f"{tuple(node_bits.shape)}")
    W = node_bits.shape[2]
    if tuple(root_bits.shape) != (B, W) or root_bits.dtype != torch.int64:
        raise ValueError(f"root_bits must be int64 [B, W] = {(B, W)}, got {root_bits.dtype} {tuple(root_bits.shape)}")
    if cost_table.dim() != 1 or not cost_table.is_floating_point():
        raise ValueError(f"cost_table must be a 1-D float tensor, got {cost_table.dtype} {tuple(cost_table.shape)}")
    devices = {t.device for t in (scores, parents, valid, depth, node_bits, root_bits, cost_table)}
    if len(devices) != 1:
        raise ValueError(f"select_tree inputs are on different devices: {sorted(map(str, devices))}")
    if not isinstance(budget, (int, torch.SymInt)) or budget < 1:
        raise ValueError(f"budget must be a positive integer, got {budget!r}")
    for name, x in (("c0", c0), ("c_tok", c_tok), ("c_exp", c_exp), ("eps", eps)):
        if not math.isfinite(x):
            raise ValueError(f"{name} must be finite, got {x}")
    max_k = -1
    if mode == Mode.EVICT:
        if cost_table.shape[0] < 1:
            raise ValueError("evict needs a cost table C(0) .. C(K) (got an empty one)")
        max_k = cost_table.shape[0] - 1
    elif mode in (Mode.ECOSPEC, Mode.ECOSPEC_GLOBAL):
        if not eps > 0:
            raise ValueError(f"ecospec eps must be > 0, got {eps}")
    elif mode == Mode.JOINT:
        _check_joint(c0, c_tok, c_exp, min(budget, N))
    return SelectShapes(B, N, W, max_k)


def _check_joint(c0: float, c_tok: float, c_exp: float, max_nodes: int) -> None:
    """Require C(j, U) > 0 for every j <= max_nodes and U >= 0, so no data can make it fail."""
    if c_exp < 0:
        raise ValueError(f"joint c_exp must be >= 0, got {c_exp}")
    if not c0 + min(0.0, c_tok * max_nodes) > 0:
        raise ValueError(f"joint cost model c0={c0}, c_tok={c_tok} predicts a non-positive step cost "
                         f"for some j <= {max_nodes}")
