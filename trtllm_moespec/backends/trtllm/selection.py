"""Node selection inside TensorRT-LLM's drafting loop, graph-safe where the policy allows.

`resampling_final_draft_tokens` runs inside the one-model forward that TensorRT-LLM
captures as a CUDA graph, so the selection there may not synchronise with the host,
copy from pageable memory or build tensors from Python lists. Everything a selector
needs (cost table, cost-model constants, the predictor's weights) is placed on the
device when it is built; per call it only runs device kernels:

- eagle3: the top-`budget` nodes by `buffers.device_score_order` (device sorts);
- evict, ecospec, joint: the `moespec::select_tree` op (Triton kernels on CUDA);
  ecospec and joint read per-node expert bitsets from `HistoryExpertPredictor`;
- coverage: the core policy in eager PyTorch (host syncs): run it without CUDA graphs
  (`moespec build` writes `cuda_graph_config: null` for it).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from ...core.experts import pack_expert_ids
from ...core.tree import DraftTree
from .buffers import DynamicTreeHistory, device_score_order, history_depth

GRAPH_SAFE_POLICIES = ("eagle3", "evict", "ecospec", "joint")
EAGER_POLICIES = ("coverage",)
WORKER_POLICIES = GRAPH_SAFE_POLICIES + EAGER_POLICIES
EXPERT_POLICIES = ("ecospec", "joint")


@dataclass(frozen=True)
class WorkerSettings:
    """What the worker needs from the engine directory."""

    policy: str  # one of WORKER_POLICIES
    cost_profile: str | None = None  # cost_profile.json (evict needs C(k), joint its expert fit)
    predictor: str | None = None  # draft-head expert predictor directory (ecospec, joint)
    policy_options: dict[str, Any] = field(default_factory=dict)  # eps, global_cost (ecospec), rho (coverage)


def check_worker_policy(settings: WorkerSettings) -> None:
    """Raise ValueError unless the TensorRT-LLM worker can run these settings."""
    if settings.policy not in WORKER_POLICIES:
        raise ValueError(f"policy {settings.policy!r} cannot run inside the TensorRT-LLM worker; "
                         f"use one of {WORKER_POLICIES} there, or the PyTorch engine")
    if settings.policy in ("evict", "joint") and settings.cost_profile is None:
        raise ValueError(f"policy {settings.policy!r} needs the engine's cost_profile.json "
                         "(build without --dry-run on a GPU)")
    if settings.policy in EXPERT_POLICIES and settings.predictor is None:
        raise ValueError(f"policy {settings.policy!r} needs an expert predictor (moespec build --predictor DIR)")


def is_graph_safe(policy: str) -> bool:
    """Whether the worker's selection for `policy` can be captured in a CUDA graph."""
    return policy in GRAPH_SAFE_POLICIES


class Selector(ABC):
    """tree (+ expert bitsets) -> node_idx [B, budget] (-1 pad), parent-closed."""

    needs_experts = False

    @abstractmethod
    def __call__(self, tree: DraftTree, node_bits: torch.Tensor | None = None,
                 root_bits: torch.Tensor | None = None) -> torch.Tensor:
        """The selected node indices of each request."""


class TopScoreSelector(Selector):
    """eagle3: the `budget` best nodes by score, on the device."""

    def __init__(self, budget: int):
        self.budget = budget

    def __call__(self, tree, node_bits=None, root_bits=None):
        order = device_score_order(tree)[:, : self.budget]
        return torch.where(tree.valid.gather(1, order), order, torch.full_like(order, -1))


class OpSelector(Selector):
    """evict / ecospec / joint through `moespec::select_tree`; constants live on the device."""

    def __init__(self, mode: str, budget: int, device: torch.device, cost_table: torch.Tensor | None = None,
                 c0: float = 0.0, c_tok: float = 0.0, c_exp: float = 0.0, eps: float = 1e-3):
        self.mode, self.budget = mode, budget
        self.needs_experts = mode != "evict"
        # Built once here: a per-call torch.tensor(list) would be a pageable host copy.
        self.cost_table = cost_table.to(device) if cost_table is not None else torch.zeros(0, dtype=torch.float64,
                                                                                            device=device)
        self.constants = (float(c0), float(c_tok), float(c_exp), float(eps))

    def __call__(self, tree, node_bits=None, root_bits=None):
        from ...kernels import select_tree

        B, N = tree.token_ids.shape
        if node_bits is None:  # evict ignores experts: one empty word per node
            node_bits = torch.zeros(B, N, 1, dtype=torch.int64, device=tree.token_ids.device)
            root_bits = node_bits[:, 0]
        c0, c_tok, c_exp, eps = self.constants
        return select_tree(tree.scores, tree.parents, tree.valid, tree.depth, node_bits, root_bits, self.cost_table,
                           self.mode, self.budget, c0, c_tok, c_exp, eps).node_idx


class EagerSelector(Selector):
    """A core policy run eagerly (host syncs; not for captured graphs)."""

    def __init__(self, policy: Any):
        self.policy = policy

    def __call__(self, tree, node_bits=None, root_bits=None):
        return self.policy.select(tree).node_idx


def make_selector(settings: WorkerSettings, verify_length: int, device: torch.device | str = "cpu") -> Selector:
    """The selector for the captured verify length; ValueError for settings the worker cannot run."""
    from ...core.cost import CostTable

    check_worker_policy(settings)
    device = torch.device(device)
    options = dict(settings.policy_options)
    if settings.policy == "eagle3":
        return TopScoreSelector(verify_length)
    if settings.policy == "coverage":
        from ...core.policies import make_policy

        return EagerSelector(make_policy("coverage", budget=verify_length, **options))
    if settings.policy == "ecospec":
        mode = "ecospec_global" if options.get("global_cost") else "ecospec"
        return OpSelector(mode, verify_length, device, eps=float(options.get("eps", 1e-3)))
    table = CostTable.load(settings.cost_profile)
    if settings.policy == "evict":
        return OpSelector("evict", min(verify_length, table.max_nodes), device, cost_table=table.as_tensor(device))
    if table.expert_model is None:
        raise ValueError(f"policy 'joint' needs the expert cost fit (c0, c_tok, c_exp) in {settings.cost_profile}")
    m = table.expert_model
    return OpSelector("joint", verify_length, device, c0=m.c0, c_tok=m.c_tok, c_exp=m.c_exp)


class HistoryExpertPredictor:
    """Per-node expert bitsets for the history buffers, from the drafter's own hidden states.

    Our draft-head predictor (models.predictor_head) maps (proposing hidden, token
    embedding, depth) to routing logits. Inside TensorRT-LLM the proposing hidden of
    history node h is the pre-norm drafter output at parent-buffer slot h // K (slot 0:
    the last accepted position, which proposed the step-0 nodes and is the root's
    feature; slot 1 + (l-1)*K + f: frontier node f of step l), the same index rule the
    parent buffer follows. The whole forward runs on [B, H + 1] rows with no
    data-dependent branch, so it captures in a graph.
    """

    def __init__(self, predictor_dir: str | Path, num_experts: int, device: torch.device | str):
        from ...models.predictor_head import DraftHeadPredictor

        self.head = DraftHeadPredictor.load(predictor_dir).to(device)
        self.num_experts = num_experts
        if self.head.config.target_num_experts != num_experts:
            raise ValueError(f"expert predictor {predictor_dir} was trained for {self.head.config.target_num_experts} "
                             f"experts, the target has {num_experts}")

    @torch.no_grad()
    def predict(self, history: DynamicTreeHistory, slot_hidden: torch.Tensor, root_ids: torch.Tensor,
                embed: Callable[[torch.Tensor], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(node_bits [B, H, W], root_bits [B, W]) int64.

        slot_hidden: [B, P, Hd] pre-norm drafter hidden per parent-buffer slot;
        root_ids: [B] the last accepted token; embed: token ids -> target embeddings.
        """
        B, H = history.draft_tokens.shape
        K = history.topk
        slot = (torch.arange(H, device=slot_hidden.device) // K).clamp(max=slot_hidden.shape[1] - 1)
        hidden = torch.cat([slot_hidden[:, slot], slot_hidden[:, :1]], dim=1)  # [B, H + 1, Hd]
        ids = torch.cat([history.draft_tokens.long(), root_ids.long()[:, None]], dim=1)  # [B, H + 1]
        depth = torch.cat([history_depth(K, H, slot_hidden.device), torch.zeros(1, dtype=torch.int64,
                                                                                 device=slot_hidden.device)])
        logits = self.head.model(hidden, embed(ids), depth.expand(B, H + 1))  # [B, H + 1, L, E]
        topk = logits.topk(self.head.config.target_topk, dim=-1).indices
        bits = pack_expert_ids(topk, self.num_experts)  # [B, H + 1, W]
        return bits[:, :H], bits[:, H]
