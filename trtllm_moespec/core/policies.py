"""Selection policies: which draft nodes the target verifies this step.

Every policy returns, per request, an ordered parent-closed node list (each node
after its parent), its expected committed tokens 1 + sum of scores, and its
predicted cost (NaN when the policy has no cost model). Policies never look at
the verifier's random numbers, so verification stays lossless.

  ar        no drafting (plain decoding through the same path)
  eagle3    fixed top-`budget` nodes by score
  evict     top nodes by score, k* = argmax (1 + S_k) / C(k) over a profiled table
  ecospec   greedy by score / (new predicted experts + eps) up to `budget`
            (`global_cost=True`: the paper's static ablation)
            (ecospec and joint take a `placement`: under expert parallelism "new experts"
            and U count U_max, each MoE layer's busiest rank, see placement.py)
  joint     ours: greedy by score / (c_tok + c_exp * new experts), stop at the
            utility peak (1 + S_j) / (c0 + c_tok*j + c_exp*U_j); where the profile shows the
            expert term cannot pay for its predictor (`expert_term=False`, see
            core/cost.py `expert_term_pays`) it selects as evict on the measured C(k)
  coverage  smallest top prefix with S_k / S_K >= rho
  oracle    analysis only: orders by the true acceptance probability of each path

The cost-aware policies (evict, ecospec, joint, coverage: `uses_values`) are given
trees whose scores are node *values* (core/values.py: the estimated probability that
the target accepts the node given its path); with `values="raw"` those are the raw
draft path scores. Either way the scores are products along the path, so every rule
below reads "score" and stays parent-closed.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from .cost import CostTable, ExpertCostModel
from .experts import ExpertSets
from .placement import ExpertPlacement
from .select import evict_select, evict_select_host, greedy_expert_select, joint_prefix, joint_token_cost, path_bits
from .select_host import compiled_evict
from .tree import DraftTree, _score_order_host, gather_nodes, score_order, top_k_nodes


# The expert-aware policies (ecospec, joint) choose among the top nodes by value, this share of the verify
# cap (`SelectionPolicy.candidate_count`): predicting a node's experts costs per node, and the calibrated
# values already rank the nodes worth verifying first. Measured on moespec-base (its 6-step, top-8 tree of
# 328 nodes, cap 32; ecospec, 9 prompts x 96 tokens, guard off): the top 16 by value verify Mat 4.94 at a
# predictor cost of 1.0 ms a step, the top 64 by raw draft score (the rule before) 4.97 at 1.9 ms, the top 16
# by raw score 4.62.
CANDIDATE_SHARE = 0.5


@dataclass(frozen=True)
class Selection:
    node_idx: torch.Tensor  # [B, K] int64 ordered, parent before child, -1 pad
    num_selected: torch.Tensor  # [B] int64
    expected_tokens: torch.Tensor  # [B] float64, 1 + sum of selected scores
    predicted_cost: torch.Tensor  # [B] float64 seconds, NaN without a cost model


class SelectionPolicy(ABC):
    """Interface: select(tree, ...) -> Selection."""

    name: ClassVar[str]
    needs_experts: ClassVar[bool] = False  # requires per-node predicted expert sets
    needs_target: ClassVar[bool] = False  # requires target acceptance probabilities (oracle)
    drafts: ClassVar[bool] = True  # False only for plain decoding
    # Cost-aware policies rank on node values (core/values.py): the engine hands them a tree whose
    # scores are the value model's estimated acceptance probabilities instead of raw path scores.
    uses_values: ClassVar[bool] = False

    @property
    def reads_experts(self) -> bool:
        """Whether this instance reads predicted expert sets (the engine runs the predictor only then)."""
        return self.needs_experts

    def candidate_count(self, max_draft_tokens: int) -> int | None:
        """How many drafted nodes, the top ones by value, this policy chooses among (None: every one).

        A policy that reads expert sets has every candidate's experts predicted, which costs per node;
        it chooses among `CANDIDATE_SHARE` of the verify cap (`max_draft_tokens`)."""
        return max(1, math.ceil(CANDIDATE_SHARE * max_draft_tokens)) if self.reads_experts else None

    @abstractmethod
    def select(
        self,
        tree: DraftTree,
        experts: ExpertSets | None = None,
        root_experts: torch.Tensor | None = None,
        target_scores: torch.Tensor | None = None,
    ) -> Selection:
        """experts: per-node predicted sets; root_experts: [B, W];
        target_scores: [B, N] the target's local probability of each node (oracle only)."""


def _from_prefix(order: torch.Tensor, k: torch.Tensor | None, scores: torch.Tensor,
                 cost: torch.Tensor | None) -> Selection:
    """Selection = the first k[b] entries of order[b] (None: every entry that names a node; numpy inside:
    these tensors are tiny)."""
    o = order.cpu().numpy()
    kk = (o >= 0).sum(1) if k is None else k.cpu().numpy()
    return _prefix_selection(o, kk, scores.detach().cpu().numpy(), cost, order.device)


def _from_tree(order: torch.Tensor, k: torch.Tensor | None, tree: DraftTree, cost: torch.Tensor | None) -> Selection:
    """`_from_prefix` with the tree's path scores. For one CPU request (the engine's step) they are read
    at the selected nodes alone: the exp of every drafted node's score costs ~50 us in a step."""
    if tree.batch_size > 1 or order.device.type != "cpu":
        return _from_prefix(order, k, tree.scores, cost)
    o = order.numpy()
    n = int((o >= 0).sum()) if k is None else int(k.reshape(-1)[0])
    # valid nodes' path probabilities, by the same float32 exp as DraftTree.scores (the kernels match it to 1e-12)
    picked = tree.log_scores[0].index_select(0, torch.from_numpy(o[0, :n])).exp().numpy() if n else np.zeros(0)
    return _one_prefix(o, n, picked, cost)


def _prefix_selection(o: np.ndarray, kk: np.ndarray, s: np.ndarray, cost: torch.Tensor | np.ndarray | None,
                      device: torch.device) -> Selection:
    """`_from_prefix` on numpy arrays: order o [B, M], k kk [B], scores s [B, N] (float32), cost [B] or None."""
    if len(kk) == 1 and device.type == "cpu":
        k = int(kk[0])
        return _one_prefix(o, k, s[0, o[0, :k]], cost)
    keep = np.arange(o.shape[1]) < kk[:, None]
    picked = s[np.arange(len(kk))[:, None], np.maximum(o, 0)] if s.shape[1] else np.zeros(o.shape)
    expected = 1.0 + np.where(keep, picked, 0).sum(1, dtype=np.float64)  # float64 sum of the float32 scores
    to = torch.from_numpy if device.type == "cpu" else (lambda a: torch.from_numpy(a).to(device))  # noqa: E731
    if cost is None:
        cost = torch.full((len(kk),), math.nan, dtype=torch.float64, device=device)
    elif isinstance(cost, np.ndarray):
        cost = to(np.ascontiguousarray(cost))
    return Selection(to(np.where(keep, o, -1)), to(keep.sum(1).astype(np.int64)), to(expected), cost)


def _one_prefix(o: np.ndarray, k: int, picked: np.ndarray, cost: torch.Tensor | np.ndarray | None) -> Selection:
    """`_prefix_selection` of one CPU request (the engine's step), the selected nodes' scores `picked` [k]
    given: the same values in half the array ops, which a step runs on caches the target's forward just
    flushed (each costs several times its warm time)."""
    node_idx = np.full(o.shape, -1, dtype=np.int64)
    node_idx[0, :k] = o[0, :k]
    expected = 1.0 + float(picked.sum(dtype=np.float64))
    if not isinstance(cost, torch.Tensor):
        cost = torch.from_numpy(np.array([math.nan] if cost is None else cost, dtype=np.float64))
    # (from numpy: torch.tensor of a list costs ~3x as much)
    return Selection(torch.from_numpy(node_idx), torch.from_numpy(np.array([k], dtype=np.int64)),
                     torch.from_numpy(np.array([expected], dtype=np.float64)), cost)


def _check_budget(budget: int, name: str) -> None:
    if not isinstance(budget, int) or budget <= 0:
        raise ValueError(f"{name} budget must be a positive integer, got {budget!r}")


@dataclass(frozen=True)
class ArPolicy(SelectionPolicy):
    name: ClassVar[str] = "ar"
    drafts: ClassVar[bool] = False

    def select(self, tree, experts=None, root_experts=None, target_scores=None) -> Selection:
        empty = torch.full((tree.batch_size, 0), -1, dtype=torch.int64, device=tree.token_ids.device)
        return _from_tree(empty, torch.zeros(tree.batch_size, dtype=torch.int64), tree, None)


@dataclass(frozen=True)
class Eagle3Policy(SelectionPolicy):
    budget: int = 32
    name: ClassVar[str] = "eagle3"

    def __post_init__(self) -> None:
        _check_budget(self.budget, "eagle3")

    def select(self, tree, experts=None, root_experts=None, target_scores=None) -> Selection:
        return _from_tree(top_k_nodes(tree, self.budget), None, tree, None)


@dataclass(frozen=True)
class EvictPolicy(SelectionPolicy):
    cost_table: CostTable
    budget: int | None = None  # cap on verified nodes (e.g. the largest captured verify length)
    name: ClassVar[str] = "evict"
    uses_values: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if not isinstance(self.cost_table, CostTable):
            raise ValueError("evict needs a CostTable (profile one with `moespec profile`)")
        if self.budget is not None:
            _check_budget(self.budget, "evict")

    def select(self, tree, experts=None, root_experts=None, target_scores=None) -> Selection:
        return _evict(tree, tree.scores, self.cost_table, self.budget)


def _evict(tree: DraftTree, scores: torch.Tensor, table: CostTable, budget: int | None) -> Selection:
    cap = table.max_nodes if budget is None else min(budget, table.max_nodes)
    if tree.token_ids.device.type == "cpu" and tree.num_nodes:
        return _evict_host(tree, scores, table, cap)
    order = score_order(tree)[:, :cap]
    sorted_scores = gather_nodes(scores, order, 0.0)
    num_valid = torch.clamp(tree.valid.sum(1), max=cap)
    k, _, cost = evict_select(sorted_scores, num_valid, table.as_tensor(tree.token_ids.device))
    return _from_prefix(order, k, scores, cost)


def _evict_host(tree: DraftTree, scores: torch.Tensor, table: CostTable, cap: int) -> Selection:
    """`_evict` on a CPU tree without torch ops: one compiled pass (select_host.py), or numpy without numba;
    the same order, prefix and costs (small ops, not arithmetic, are what selecting costs on the CPU)."""
    s, costs = scores.detach().numpy(), table.costs_array
    kernel = compiled_evict() if tree.batch_size == 1 else None
    if kernel is not None:  # the top `cap` and k* in one compiled pass (select_host.py)
        order = np.empty((1, min(cap, tree.num_nodes)), dtype=np.int64)
        k = kernel(tree.log_scores[0].numpy(), s[0], tree.depth[0].numpy(), tree.valid[0].numpy(), costs, order[0])
        return _prefix_selection(order, np.array([k]), s, costs[[k]], tree.token_ids.device)
    order = _score_order_host(tree)[0][:, :cap]
    sorted_scores = np.take_along_axis(s, order, axis=1).astype(np.float64)
    num_valid = np.minimum(tree.valid.numpy().sum(1), cap)
    k, _, cost = evict_select_host(sorted_scores, num_valid, costs)
    return _prefix_selection(order, k, s, cost, tree.token_ids.device)


@dataclass(frozen=True)
class CoveragePolicy(SelectionPolicy):
    rho: float = 0.9
    budget: int = 32
    name: ClassVar[str] = "coverage"
    uses_values: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if not 0.0 < self.rho <= 1.0:
            raise ValueError(f"coverage rho must lie in (0, 1], got {self.rho}")
        _check_budget(self.budget, "coverage")

    def select(self, tree, experts=None, root_experts=None, target_scores=None) -> Selection:
        order = top_k_nodes(tree, self.budget)
        scores = gather_nodes(tree.scores.double(), order, 0.0)
        cu = scores.cumsum(1)
        total = cu[:, -1:] if cu.shape[1] else torch.zeros(tree.batch_size, 1, dtype=torch.float64)
        # Smallest k with S_k >= rho * S_K (k = 0 when the tree is empty or all scores are 0).
        reached = cu >= self.rho * total * (1 - 1e-12)
        k = torch.where(total[:, 0] > 0, reached.long().argmax(1) + 1, 0)
        return _from_tree(order, k, tree, None)


@dataclass(frozen=True)
class EcoSpecPolicy(SelectionPolicy):
    budget: int = 3  # draft nodes; the paper's gamma counts the bonus token too (gamma = budget + 1)
    eps: float = 1e-3
    global_cost: bool = False  # ablation: static |E_path| instead of the marginal cost
    placement: ExpertPlacement | None = None  # EP: price U_max, each layer's busiest rank (None = one device)
    name: ClassVar[str] = "ecospec"
    uses_values: ClassVar[bool] = True
    needs_experts: ClassVar[bool] = True

    def __post_init__(self) -> None:
        _check_budget(self.budget, "ecospec")
        if not self.eps > 0:
            raise ValueError(f"ecospec eps must be > 0, got {self.eps}")

    def candidate_count(self, max_draft_tokens: int) -> int | None:
        # ecospec always fills its budget: it chooses among at least that many nodes
        return max(super().candidate_count(max_draft_tokens), self.budget)

    def select(self, tree, experts=None, root_experts=None, target_scores=None) -> Selection:
        traj = _trajectories(tree, experts, self.name)
        greedy = greedy_expert_select(
            tree.scores, tree.parents, tree.valid, traj, None if self.global_cost else root_experts,
            self.budget, token_cost=self.eps, expert_cost=1.0, marginal=not self.global_cost,
            placement=_checked_placement(self.placement, experts),
        )
        return _from_tree(greedy.node_idx, greedy.num_selected, tree, None)


@dataclass(frozen=True)
class JointPolicy(SelectionPolicy):
    cost_model: ExpertCostModel
    budget: int = 32  # cap on verified nodes
    placement: ExpertPlacement | None = None  # EP: C(k, U_max), U_max = sum over layers of the busiest rank's experts
    # False: the expert term cannot pay for its predictor here, so select as EVICT on the measured C(k)
    # (the engine then runs no predictor); needs `cost_table`
    expert_term: bool = True
    cost_table: CostTable | None = None
    name: ClassVar[str] = "joint"
    uses_values: ClassVar[bool] = True
    needs_experts: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if not isinstance(self.cost_model, ExpertCostModel):
            raise ValueError("joint needs an ExpertCostModel (fitted by `moespec profile`)")
        _check_budget(self.budget, "joint")
        if not isinstance(self.expert_term, bool):
            raise ValueError(f"joint expert_term must be True or False, got {self.expert_term!r}")
        if not self.expert_term and not isinstance(self.cost_table, CostTable):
            raise ValueError("joint without its expert term selects on the measured C(k): it needs a CostTable")

    @property
    def reads_experts(self) -> bool:
        return self.expert_term

    def select(self, tree, experts=None, root_experts=None, target_scores=None) -> Selection:
        if not self.expert_term:
            return _evict(tree, tree.scores, self.cost_table, self.budget)
        m = self.cost_model
        traj = _trajectories(tree, experts, self.name)
        token_cost = joint_token_cost(m.c_tok, m.c_exp)
        greedy = greedy_expert_select(
            tree.scores, tree.parents, tree.valid, traj, root_experts, self.budget, token_cost, m.c_exp,
            placement=_checked_placement(self.placement, experts),
        )
        j, _, cost = joint_prefix(greedy, m.c0, m.c_tok, m.c_exp)
        return _from_tree(greedy.node_idx, j, tree, cost)


@dataclass(frozen=True)
class OraclePolicy(SelectionPolicy):
    """Analysis-only upper bound: the true acceptance probability of each path as its score.

    target_scores [B, N] are the target's local probabilities p(token_v | path to v's parent)
    (under the verifier's temperature / top-k / top-p; one-hot at temperature 0).

    With a cost table it maximises (1 + S_k) / C(k) over those scores; without one it
    verifies every node the target could accept (at T=0: exactly the accepted chain).
    """

    cost_table: CostTable | None = None
    name: ClassVar[str] = "oracle"
    needs_target: ClassVar[bool] = True

    def select(self, tree, experts=None, root_experts=None, target_scores=None) -> Selection:
        if target_scores is None or target_scores.shape != tree.token_ids.shape:
            raise ValueError("oracle needs target_scores [B, N]: the target's probability of each node's token given its path")
        # Path products of the target's local probabilities: the true acceptance probability.
        oracle_tree = DraftTree.from_parents(tree.token_ids, tree.parents, target_scores.clamp(0.0, 1.0), tree.valid)
        scores = oracle_tree.scores
        if self.cost_table is not None:
            return _evict(oracle_tree, scores, self.cost_table, None)
        order = score_order(oracle_tree)
        k = ((scores > 0) & tree.valid).sum(1)
        return _from_prefix(order, k, scores, None)


def _trajectories(tree: DraftTree, experts: ExpertSets | None, name: str) -> torch.Tensor:
    if experts is None:
        raise ValueError(f"{name} needs predicted expert sets per node (load an expert predictor)")
    if experts.bits.shape[:2] != tree.token_ids.shape:
        raise ValueError(
            f"expert sets cover {tuple(experts.bits.shape[:2])} nodes but the tree has {tuple(tree.token_ids.shape)}"
        )
    return path_bits(experts.bits, tree.parents, tree.depth)


def _checked_placement(placement: ExpertPlacement | None, experts: ExpertSets) -> ExpertPlacement | None:
    if placement is None:
        return None
    if (placement.num_layers, placement.num_experts) != (experts.num_layers, experts.num_experts):
        raise ValueError(f"expert placement covers {placement.num_layers} layers x {placement.num_experts} experts, "
                         f"the predicted sets {experts.num_layers} x {experts.num_experts}")
    return placement


def ddd_should_stop(frontier_scores: torch.Tensor, threshold: float) -> torch.Tensor:
    """DDD's dynamic-depth rule: [B] True where the frontier's summed score < threshold."""
    if not threshold >= 0:
        raise ValueError(f"ddd threshold must be >= 0, got {threshold}")
    return frontier_scores.sum(-1) < threshold


POLICIES: dict[str, type[SelectionPolicy]] = {
    cls.name: cls
    for cls in (ArPolicy, Eagle3Policy, EvictPolicy, EcoSpecPolicy, JointPolicy, CoveragePolicy, OraclePolicy)
}


def make_policy(name: str, **options) -> SelectionPolicy:
    """Build a policy by name; unknown names or options raise ValueError."""
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; choose one of {sorted(POLICIES)}")
    try:
        return POLICIES[name](**options)
    except TypeError as e:
        raise ValueError(f"bad options for policy {name!r}: {e}") from None
