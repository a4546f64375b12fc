"""Draft sources the engine can run: EAGLE-3, n-gram lookup, or none (plain decoding).

Each keeps its per-request state in an object the engine passes back on every call,
so one loaded model can serve many requests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..core.tree import DraftTree
from ..core.verify import VerifyResult
from ..models.target import TargetOutput


@dataclass(frozen=True)
class Draft:
    tree: DraftTree  # [1, N] the drafted tree
    node_hidden: torch.Tensor | None  # [1, N, H] drafter features per node (EAGLE-3), else None


class NoDraft:
    """Plain decoding: every step verifies only the root."""

    name = "none"

    def start(self, prompt_ids: torch.Tensor, prefill: TargetOutput, root: int) -> None:
        return None

    def draft(self, state: Any, context: list[int], device: torch.device) -> Draft:
        return Draft(DraftTree.empty(1, device=device), None)

    def commit(self, state: Any, result: VerifyResult, verify: TargetOutput) -> None:
        return None


class Eagle3Source:
    """EAGLE-3 drafting with (steps, topk) and the optional DDD stop rule."""

    name = "eagle3"

    def __init__(self, drafter, steps: int, topk: int, ddd_threshold: float | None = None):
        self.drafter, self.steps, self.topk, self.ddd_threshold = drafter, steps, topk, ddd_threshold

    def start(self, prompt_ids: torch.Tensor, prefill: TargetOutput, root: int):
        cache = self.drafter.new_cache()
        self.drafter.prefill(cache, prompt_ids, prefill.hidden, next_token=root)
        return cache

    def draft(self, state, context: list[int], device: torch.device) -> Draft:
        out = self.drafter.draft_tree(state, self.steps, self.topk, self.ddd_threshold)
        return Draft(out.tree, out.node_hidden)

    def commit(self, state, result: VerifyResult, verify: TargetOutput) -> None:
        self.drafter.commit(state, result.accepted_pos[0], result.emitted_ids[0], verify.hidden)


class NgramSource:
    """Weightless prompt-lookup drafting (the EVICT paper's Lookahead baseline)."""

    name = "ngram"

    def __init__(self, drafter):
        self.drafter = drafter

    def start(self, prompt_ids: torch.Tensor, prefill: TargetOutput, root: int) -> None:
        return None

    def draft(self, state, context: list[int], device: torch.device) -> Draft:
        return Draft(self.drafter.draft_tree(torch.tensor(context, device=device)), None)

    def commit(self, state, result: VerifyResult, verify: TargetOutput) -> None:
        return None
