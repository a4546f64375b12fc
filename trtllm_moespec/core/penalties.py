"""Repetition, presence and frequency penalties, applied losslessly to a whole verified tree.

A penalty makes the target distribution at a position depend on the tokens before it, so every
layout position is penalized under its own context: the request's history (prompt and committed
output) followed by the draft tokens on its path from the root. The acceptance rule then runs on
those distributions exactly as on unpenalized ones, so a speculative step emits what plain decoding
with the same penalties would (greedy: the same tokens; sampling: the same distribution). The
drafter drafts without penalties: that may lower acceptance, never change the output.

The rules are vLLM's (and, for repetition, transformers' `RepetitionPenaltyLogitsProcessor`), in
vLLM's order, before temperature, top-k and top-p:
  repetition r: a token of the prompt or the output gets logit / r when its logit is > 0, else logit * r
  frequency f:  logit -= f * (times the token occurs in the output)
  presence p:   logit -= p * (1 if the token occurs in the output)
Reported logprobs stay the raw model's (core/logprobs.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .layout import TreeLayout

MAX_ADDITIVE_PENALTY = 2.0  # OpenAI's range for presence and frequency penalties: [-2, 2]


@dataclass(frozen=True)
class Penalties:
    """A request's penalties (validated on construction; the defaults change nothing)."""

    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0

    def __post_init__(self) -> None:
        for name in ("presence", "frequency"):
            value = getattr(self, name)
            if not (_is_number(value) and -MAX_ADDITIVE_PENALTY <= value <= MAX_ADDITIVE_PENALTY):
                raise ValueError(f"{name}_penalty must be a number in [-2, 2], got {value!r}")
        if not (_is_number(self.repetition) and math.isfinite(self.repetition) and self.repetition > 0):
            raise ValueError(f"repetition_penalty must be a finite number > 0 (1 = off), got {self.repetition!r}")

    @property
    def active(self) -> bool:
        return self.presence != 0 or self.frequency != 0 or self.repetition != 1


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


class TokenHistory:
    """A request's tokens as its penalties read them: how often each token occurs in the output, and
    which tokens the prompt or the output hold. Extended with every committed token."""

    def __init__(self, penalties: Penalties, prompt_ids: list[int], vocab_size: int, device: torch.device | str = "cpu"):
        self.penalties = penalties
        self.counts = torch.zeros(vocab_size, device=device)  # [V] float32 occurrences in the output
        self.seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)  # [V] in the prompt or the output
        self.seen[torch.tensor(prompt_ids, dtype=torch.int64, device=device)] = True

    def extend(self, tokens: list[int]) -> None:
        """Committed output tokens."""
        if tokens:
            ids = torch.tensor(tokens, dtype=torch.int64, device=self.counts.device)
            self.counts.index_put_((ids,), torch.ones(len(tokens), device=ids.device), accumulate=True)
            self.seen[ids] = True

    def apply(self, logits: torch.Tensor, layout: TreeLayout | None, row: int = 0) -> torch.Tensor:
        """logits [T, V] at request `row`'s layout positions -> new penalized float32 logits [T, V], each
        position under the history followed by the draft tokens on its path (the root is the history's
        last token; a node's own token is part of its context). A root alone (T = 1) needs no layout."""
        T = logits.shape[0]
        counts, seen = self.counts[None], self.seen[None]  # [1, V]
        if T > 1:
            path = layout.paths[row, :T, 1:]  # [T, D] positions of the nodes on each path (depth >= 1), -1 pad
            tokens = layout.token_ids[row][path.clamp(min=0)]  # [T, D]
            on_path = torch.zeros_like(logits, dtype=torch.float32)
            on_path.scatter_add_(1, tokens, (path >= 0).float())
            counts, seen = counts + on_path, seen | (on_path > 0)  # [T, V]
        p = self.penalties
        out = logits.float()
        if p.repetition != 1:
            out = torch.where(seen, torch.where(out > 0, out / p.repetition, out * p.repetition), out)
        if p.frequency != 0:
            out = out - p.frequency * counts
        if p.presence != 0:
            out = out - p.presence * (counts > 0).float()
        return out
