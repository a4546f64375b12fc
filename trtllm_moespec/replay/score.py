"""Offline scoring of selection policies and value models on recorded steps.

For every recorded step, each policy selects from the recorded tree (with the recorded
predicted expert sets and its own value model, whose online state follows the policy's
own selections and outcomes, per request as live). Then:

  realized tokens  T=0: 1 + the accepted chain's prefix inside the selection (exact);
                   T>0: 1 + sum over selected nodes of the target's path probability
                   (the expected accepted count of multi-draft verification with distinct
                   deterministic drafts: each node is accepted with its target path probability)
  cost             `fit`: c0 + c_tok*k + c_exp*U with U the TRUE unique (layer, expert)
                   pairs of root + selected nodes (from the peek); `table`: the profiled C(k)
  oracle           the selection that maximises tokens / cost knowing the target's verdicts
                   (score order of the true path probabilities, best prefix); its peek is not charged.

Steps are scored independently (the recorded trajectory is kept), the usual replay
approximation; `tests/replay` pins that replaying the live policy reproduces the live
selections and accepted counts.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from ..core.cost import CostTable
from ..core.experts import ExpertSets, popcount
from ..core.policies import SelectionPolicy
from ..core.sampling import SamplingConfig
from ..core.tree import keep_top_valued, score_order
from ..core.values import path_values, with_values
from .records import ReplayFile, StepRecord


@dataclass(frozen=True)
class StepCost:
    """How one step's cost is charged."""

    table: CostTable
    use_fit: bool  # C(k, U) with the true expert union instead of the table's C(k)

    def __call__(self, step: StepRecord, selected: list[int]) -> float:
        k = len(selected)
        if not self.use_fit:
            return self.table.costs[min(k, self.table.max_nodes)]
        m = self.table.expert_model
        union = step.root_true_experts[0].clone()
        for v in selected:
            union |= step.true_experts[0, v]
        return m.c0 + m.c_tok * k + m.c_exp * int(popcount(union).sum())


class _Draft:
    """What a value model reads from a draft: the per-node drafter features."""

    def __init__(self, node_hidden):
        self.node_hidden = node_hidden


def with_true_experts(step: StepRecord) -> StepRecord:
    """The step as a perfect expert predictor would show it: the target's own routing of every node and the root."""
    predicted = step.experts
    return replace(step, experts=ExpertSets(step.true_experts, predicted.num_layers, predicted.num_experts),
                   root_experts=step.root_true_experts)


def true_values(step: StepRecord) -> torch.Tensor:
    """[1, N] the target's acceptance probability of every node's whole path (1/0 at T=0)."""
    return path_values(step.tree, step.target_local.clamp(0.0, 1.0))


def realized_accepts(step: StepRecord, selected: list[int], rng: np.random.Generator | None) -> tuple[float, list[int]]:
    """(expected accepted nodes, the accepted node list observed) for a selection.

    T=0: the walk is deterministic and the expectation is exact. T>0: the expectation is the sum
    of true path probabilities; the observed list is one walk sampled with `rng` (for online values)."""
    truth = true_values(step)[0]
    sel = set(selected)
    parents, local = step.tree.parents[0].tolist(), step.target_local[0].tolist()
    children: dict[int, list[int]] = {}
    for v in selected:
        children.setdefault(parents[v], []).append(v)
    walk, node = [], -1
    while node in children:
        u, nxt = rng.uniform() if step.temperature > 0 else 0.5, None
        acc = 0.0
        for c in children[node]:  # sampling the target token = accepting child c with prob p(c)
            acc += local[c]
            if (step.temperature == 0 and local[c] >= 0.5) or (step.temperature > 0 and u < acc):
                nxt = c
                break
        if nxt is None:
            break
        walk.append(nxt)
        node = nxt
    expected = float(len(walk)) if step.temperature == 0 else float(sum(truth[v] for v in sel))
    return expected, walk


def oracle_selection(step: StepRecord, cost: StepCost, max_nodes: int) -> list[int]:
    """The best prefix (tokens / cost) of the true-value order: what a perfect value model would verify."""
    truth = true_values(step)
    return best_prefix(step, score_order(with_values(step.tree, truth))[0].tolist(), cost, max_nodes)


def best_prefix(step: StepRecord, order: list[int], cost: StepCost, max_nodes: int) -> list[int]:
    """The prefix of a parent-closed node `order` with the most tokens per cost, knowing the target's
    verdicts. For the true-value order it is the oracle; for a value model's order it bounds what any
    stop rule on that order could reach (the rest of the gap to the oracle is the order itself)."""
    t = true_values(step)[0]
    order = [v for v in order if bool(step.tree.valid[0, v])][:max_nodes]
    # a parent-closed prefix holds a prefix of the accepted chain: its tokens are 1 + the true values it holds;
    # past the last node of positive value a longer prefix only adds cost
    end = max((j + 1 for j, v in enumerate(order) if t[v] > 0), default=0)
    best, best_j, tokens = 1.0 / cost(step, []), 0, 1.0
    for j in range(1, end + 1):
        tokens += float(t[order[j - 1]])
        u = tokens / cost(step, order[:j])
        if u > best:
            best, best_j = u, j
    return order[:best_j]


@dataclass
class PolicyTally:
    label: str
    steps: int = 0
    tokens: float = 0.0
    cost_s: float = 0.0
    verified: int = 0

    def add(self, tokens: float, cost_s: float, verified: int) -> None:
        self.steps, self.tokens, self.cost_s, self.verified = (self.steps + 1, self.tokens + tokens,
                                                                self.cost_s + cost_s, self.verified + verified)

    def as_dict(self) -> dict:
        return {"label": self.label, "steps": self.steps, "tokens": round(self.tokens, 4), "cost_s": round(self.cost_s, 6),
                "tokens_per_s": self.tokens / self.cost_s if self.cost_s else 0.0,
                "tokens_per_step": self.tokens / max(self.steps, 1), "verified_per_step": self.verified / max(self.steps, 1)}


def replay_policy(records: ReplayFile, label: str, policy: SelectionPolicy | None, value_model, cost: StepCost,
                  max_nodes: int, seed: int = 0, steps: list[int] | None = None,
                  hindsight: bool = False, true_experts: bool = False) -> tuple[PolicyTally, list[list[int]]]:
    """Score one policy (None = the oracle selection) over the steps; returns the tally and each step's selection.
    `hindsight`: instead of the policy's own stop, the best prefix of its value order (`best_prefix`).
    `true_experts`: an expert-aware policy reads the target's true routing of every node instead of the
    recorded prediction (a perfect predictor: the most its expert term can give on these steps)."""
    tally, selections = PolicyTally(label), []
    state, request = None, None
    rng = np.random.default_rng(seed)
    for s in (range(records.num_steps) if steps is None else steps):
        step = records.step(s)
        if true_experts:
            step = with_true_experts(step)
        if step.request != request:
            request = step.request
            uses = policy is not None and policy.uses_values and value_model is not None
            state = value_model.for_request(SamplingConfig(temperature=step.temperature)) if uses else None
        if policy is None:
            selected = oracle_selection(step, cost, max_nodes)
        else:
            tree = step.tree
            valued = with_values(tree, state.values(tree, _Draft(step.node_hidden), step.context)) if state else tree
            m = policy.candidate_count(max_nodes)
            if m is not None:  # the nodes the policy chooses among live (`SpecEngine.candidates`)
                tree, valued = keep_top_valued(tree, valued, m)
            if hindsight:
                selected = best_prefix(step, score_order(valued)[0].tolist(), cost, max_nodes)
            else:
                sel = policy.select(valued, experts=step.experts, root_experts=step.root_experts,
                                    target_scores=step.target_local)
                selected = [v for v in sel.node_idx[0].tolist() if v >= 0]
        accepted, walk = realized_accepts(step, selected, rng)
        if state is not None:
            node_idx = torch.tensor([selected], dtype=torch.int64).reshape(1, -1)
            state.observe(tree, node_idx, torch.tensor([walk or [-1]], dtype=torch.int64))
        tally.add(1.0 + accepted, cost(step, selected), len(selected))
        selections.append(selected)
    return tally, selections


def ranking(records: ReplayFile, value_models: dict, ks: tuple[int, ...], budget: int,
            steps: list[int] | None = None) -> dict[str, dict[int, float]]:
    """Mean accepted nodes (T=0 chain) held by the top-k nodes by value, per value model.

    Online value models observe what verifying their own top-`budget` would have shown
    (as eagle3 on those values). 'oracle' ranks by the true path values."""
    out = {name: {k: 0.0 for k in ks} for name in list(value_models) + ["oracle"]}
    n = 0
    states: dict[str, object] = {}
    request = None
    rng = np.random.default_rng(0)
    for s in (range(records.num_steps) if steps is None else steps):
        step = records.step(s)
        if step.temperature != 0:
            raise ValueError("the ranking report needs greedy (T=0) records: acceptance must be a set of nodes")
        if step.request != request:
            request = step.request
            states = {name: m.for_request(SamplingConfig()) for name, m in value_models.items()}
        _, chain = realized_accepts(step, [v for v in range(step.tree.num_nodes) if bool(step.tree.valid[0, v])], rng)
        chain_set = set(chain)
        n += 1
        ranked = {name: st.values(step.tree, _Draft(step.node_hidden), step.context) for name, st in states.items()}
        ranked["oracle"] = true_values(step)
        for name, vals in ranked.items():
            order = score_order(with_values(step.tree, vals))[0].tolist()
            for k in ks:
                out[name][k] += len(chain_set.intersection(order[:k]))
            if name in states:
                top = order[:budget]
                _, walk = realized_accepts(step, top, rng)
                states[name].observe(step.tree, torch.tensor([top]), torch.tensor([walk or [-1]]))
    return {name: {k: v / max(n, 1) for k, v in d.items()} for name, d in out.items()}


def live_agreement(records: ReplayFile, policy: SelectionPolicy, value_model, cost: StepCost, max_nodes: int
                   ) -> tuple[int, int]:
    """(steps whose replayed selection and accepted count equal the live ones, steps checked)."""
    _, selections = replay_policy(records, "live", policy, value_model, cost, max_nodes)
    same = 0
    for s, sel in enumerate(selections):
        step = records.step(s)
        accepted, _ = realized_accepts(step, sel, np.random.default_rng(0))
        same += int(sel == step.live_selected and int(accepted) == step.live_num_accepted)
    return same, records.num_steps

