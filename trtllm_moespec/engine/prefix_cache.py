"""Prefix caching: finished requests' K/V, reused by new prompts that start the same way.

A chat client sends the whole conversation again at every turn, and many requests share a system
prompt: their prefill recomputes keys the engine computed a moment ago. When a request finishes,
its cache slot (which holds the K/V of its prompt and of every output token but the last, at
positions 0..n-1) is kept as an entry, with those positions' capture hiddens and expert ids (an
EAGLE-3 drafter started on a new request needs the target's features at every prompt position).
A new prompt that shares at least `min_tokens` leading tokens with an entry gets that prefix's K/V
copied into its own slot (one copy over all layers) and prefills only the rest. An EAGLE-3 drafter
that ran for the kept request leaves its cache too: the new request's drafter copies the positions
the shared prefix determines and runs only over the rest.

The reused keys are the ones the same tokens at the same positions produce, so outputs equal a
full prefill's up to float rounding (the prefix was computed in forwards of other lengths, as a
batched prefill's is): greedy tokens are unchanged, which the tests check. Entries hold one static-cache
slot each; at most `max_entries` are kept, the least recently used going first. Only the lean
forward's static cache supports it (`model_impl="lean"`).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..models.target import TargetCache, TargetModel, TargetOutput

MIN_REUSE_TOKENS = 16  # shorter shared prefixes are prefilled again: a copy and a second forward do not pay


@dataclass(frozen=True)
class _Entry:
    tokens: np.ndarray  # [n] int64 the tokens whose K/V the slot holds at positions 0..n-1
    cache: TargetCache  # keeps the slot
    hidden: torch.Tensor | None  # [1, n, 3H] their capture hiddens (None: the engine's drafter reads none)
    expert_ids: torch.Tensor | None  # [1, n, L_moe, topk] their router choices (None with hidden)
    drafter: Any = None  # the request's EAGLE-3 drafter cache (models.eagle3.Eagle3Cache), if its drafter ran


@dataclass(frozen=True)
class DrafterPrefix:
    """What a new request's drafter may copy from a kept one: the first `length` positions of `cache`
    (drafter position t pairs target position t's hidden with token t+1, so t < m - 1 of an m-token
    shared prefix)."""

    cache: Any  # models.eagle3.Eagle3Cache
    length: int


class SequenceFeatures:
    """A running request's capture hiddens and expert ids at its committed cache positions, in order:
    the prompt's from the prefill, then each step's root and accepted nodes (what an entry made from the
    request must give a drafter started on a reused prefix)."""

    def __init__(self, prefill: TargetOutput):
        self._hidden, self._expert_ids = [prefill.hidden], [prefill.expert_ids]

    def add(self, out: TargetOutput, positions: torch.Tensor) -> None:
        """The step's committed layout positions [n] of its verify output."""
        if positions.device != out.hidden.device:  # .to() costs ~4 us even when it has nothing to do
            positions = positions.to(out.hidden.device)
        self._hidden.append(out.hidden.index_select(1, positions))
        self._expert_ids.append(out.expert_ids.index_select(1, positions))

    def first(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden [1, n, 3H], expert ids [1, n, L_moe, topk]) of the first n committed positions."""
        hidden, expert_ids = torch.cat(self._hidden, dim=1), torch.cat(self._expert_ids, dim=1)
        if hidden.shape[1] < n:
            raise ValueError(f"features of {hidden.shape[1]} positions, {n} wanted")
        return hidden[:, :n], expert_ids[:, :n]


class PrefixCache:
    """Up to `max_entries` finished prompts' K/V for new prompts with the same beginning."""

    def __init__(self, target: TargetModel, max_entries: int, min_tokens: int = MIN_REUSE_TOKENS):
        if not isinstance(max_entries, int) or max_entries < 1:
            raise ValueError(f"a prefix cache needs max_entries >= 1, got {max_entries!r}")
        if getattr(target, "lean", None) is None:
            raise ValueError("prefix caching needs the lean forward's static cache (model_impl='lean')")
        self.target, self.max_entries, self.min_tokens = target, max_entries, max(int(min_tokens), 1)
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        self.hits = self.misses = 0
        self.reused_tokens = 0  # prompt tokens not prefilled thanks to the cache

    def __len__(self) -> int:
        return len(self._entries)

    def match(self, prompt_ids: list[int]) -> tuple[_Entry | None, int]:
        """The entry sharing the longest prefix with the prompt, and how many of the prompt's tokens it
        covers (at most all but the last: the first output token needs a forward over it)."""
        prompt = np.asarray(prompt_ids, dtype=np.int64)
        best, best_len = None, 0
        for entry in self._entries.values():
            n = min(len(entry.tokens), len(prompt) - 1)
            differ = np.flatnonzero(entry.tokens[:n] != prompt[:n])
            shared = int(differ[0]) if differ.size else n
            if shared > best_len:
                best, best_len = entry, shared
        return (best, best_len) if best_len >= self.min_tokens else (None, 0)

    def prefill(self, cache: TargetCache, prompt: torch.Tensor) -> tuple[TargetOutput, DrafterPrefix | None]:
        """`target.prefill(cache, prompt)` for prompt [1, L] into an empty cache, reusing the longest
        cached prefix: logits of the last prompt token, hiddens and expert ids of all L tokens (of the
        recomputed ones only when the entry kept none: its engine's drafter reads no target features),
        and what the request's drafter may copy from the entry's (None: start from scratch)."""
        entry, m = self.match(prompt[0].tolist())
        if entry is None:
            self.misses += 1
            return self.target.prefill(cache, prompt), None
        self.hits += 1
        self.reused_tokens += m
        self._entries.move_to_end(id(entry.cache))
        self.target.copy_prefix(cache, entry.cache, m)
        rest = self.target.prefill(cache, prompt[:, m:])
        if entry.hidden is None:
            return rest, None
        k = min(m - 1, entry.drafter.num_tokens) if entry.drafter is not None else 0
        out = TargetOutput(logits=rest.logits, hidden=torch.cat([entry.hidden[:, :m], rest.hidden], dim=1),
                           expert_ids=torch.cat([entry.expert_ids[:, :m], rest.expert_ids], dim=1))
        return out, DrafterPrefix(entry.drafter, k) if k > 0 else None

    def store(self, tokens: list[int], cache: TargetCache, features: SequenceFeatures | None,
              drafter_cache: Any = None) -> None:
        """Keep a finished request's slot: `tokens` its prompt and output, of which the cache holds the
        K/V of the first `cache.num_tokens` (all but the last output token; fewer when a stop string
        cut committed tokens), `features` of those positions when its drafter needs them (None:
        kept without), and its drafter's cache if the drafter ran. The request must use neither
        cache any more."""
        n = min(cache.num_tokens, len(tokens))
        if cache.num_pending or n < self.min_tokens:
            return
        kept = np.asarray(tokens[:n], dtype=np.int64)
        for key, entry in list(self._entries.items()):  # an entry this one extends (a chat's earlier turn) goes
            if len(entry.tokens) <= n and np.array_equal(entry.tokens, kept[:len(entry.tokens)]):
                del self._entries[key]
        hidden, expert_ids = features.first(n) if features is not None else (None, None)
        self._entries[id(cache)] = _Entry(kept, cache, hidden, expert_ids, drafter_cache)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)  # the least recently used: its slot returns to the pool

    def clear(self) -> None:
        self._entries.clear()
