"""Per-request logit rules (penalties, logit bias, a minimum output length), applied losslessly to a
whole verified tree.

A rule that reads the tokens before a position (a penalty, the output length) makes the target
distribution there depend on them, so every layout position is processed under its own context:
the request's history (prompt and committed output) followed by the draft tokens on its path from
the root. The acceptance rule then runs on those distributions exactly as on raw ones, so a
speculative step emits what plain decoding under the same rules would (greedy: the same tokens;
sampling: the same distribution). The drafter drafts without them: that may lower acceptance,
never change the output.

The rules are vLLM's, in vLLM's order, before temperature, top-k, min-p and top-p:
  min_tokens m:  the stop tokens (eos, stop_token_ids) are banned while the output holds fewer than m tokens
  allowed ids:   every token outside vLLM's allowed_token_ids is banned
  bad words:     a bad word's last token is banned where the context ends with the rest of it (vLLM's)
  logit_bias:    a fixed value added to chosen tokens' logits (OpenAI's, in [-100, 100])
  repetition r:  a token of the prompt or the output gets logit / r when its logit is > 0, else logit * r
                 (also transformers' `repetition_penalty`)
  frequency f:   logit -= f * (times the token occurs in the output)        (OpenAI's, in [-2, 2])
  presence p:    logit -= p * (1 if the token occurs in the output)         (OpenAI's, in [-2, 2])
Reported logprobs stay the raw model's (core/logprobs.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .layout import TreeLayout

MAX_ADDITIVE_PENALTY = 2.0  # OpenAI's range for presence and frequency penalties: [-2, 2]
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a logit bias: [-100, 100]
# A token min_tokens holds back gets this logit: finite, because verification refuses non-finite logits
# (they mean a corrupt forward), yet far enough below any real one that it has probability 0 after
# any temperature, penalty or bias.
BANNED_LOGIT = -1e30


@dataclass(frozen=True)
class LogitRules:
    """A request's logit rules (validated on construction; the defaults change nothing)."""

    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias)
    min_tokens: int = 0
    allowed: tuple[int, ...] = ()  # vLLM's allowed_token_ids: only these may be drawn (empty: all)
    bad_words: tuple[tuple[int, ...], ...] = ()  # token sequences that may not be completed (vLLM's bad_words)

    def __post_init__(self) -> None:
        for name in ("presence", "frequency"):
            value = getattr(self, name)
            if not (_is_number(value) and -MAX_ADDITIVE_PENALTY <= value <= MAX_ADDITIVE_PENALTY):
                raise ValueError(f"{name}_penalty must be a number in [-2, 2], got {value!r}")
        if not (_is_number(self.repetition) and math.isfinite(self.repetition) and self.repetition > 0):
            raise ValueError(f"repetition_penalty must be a finite number > 0 (1 = off), got {self.repetition!r}")
        for token, bias in self.logit_bias:
            if not (_is_int(token) and token >= 0 and _is_number(bias) and -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS):
                raise ValueError(f"logit_bias must map token ids >= 0 to numbers in [-100, 100], got {token!r}: {bias!r}")
        if not (_is_int(self.min_tokens) and self.min_tokens >= 0):
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if not all(_is_int(t) and t >= 0 for t in self.allowed):
            raise ValueError(f"allowed_token_ids must be token ids >= 0, got {self.allowed!r}")
        if not all(word and all(_is_int(t) and t >= 0 for t in word) for word in self.bad_words):
            raise ValueError(f"bad_words must be non-empty token-id sequences, got {self.bad_words!r}")

    @property
    def active(self) -> bool:
        return (self.presence != 0 or self.frequency != 0 or self.repetition != 1 or bool(self.logit_bias)
                or self.min_tokens > 0 or bool(self.allowed) or bool(self.bad_words))


def _draft_paths(layout: TreeLayout | None, row: int, T: int) -> list[list[int]]:
    """Per layout position of request `row`, the draft tokens on its path from the root (the root's: none)."""
    if T == 1:
        return [[]]
    tokens = layout.token_ids[row].tolist()
    return [[tokens[p] for p in path[1:] if p >= 0] for path in layout.paths[row, :T].tolist()]


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class TokenHistory:
    """A request's tokens as its logit rules read them: how often each token occurs in the output, and
    which tokens the prompt or the output hold. Extended with every committed token."""

    def __init__(self, rules: LogitRules, prompt_ids: list[int], vocab_size: int, stop_ids: frozenset[int] = frozenset(),
                 device: torch.device | str = "cpu"):
        if any(t >= vocab_size for t, _ in rules.logit_bias):
            raise ValueError(f"logit_bias names a token id outside the vocabulary [0, {vocab_size})")
        if any(t >= vocab_size for t in rules.allowed):
            raise ValueError(f"allowed_token_ids names a token id outside the vocabulary [0, {vocab_size})")
        if any(t >= vocab_size for word in rules.bad_words for t in word):
            raise ValueError(f"bad_words holds a token id outside the vocabulary [0, {vocab_size})")
        if rules.allowed and rules.min_tokens and set(rules.allowed) <= stop_ids:
            raise ValueError("allowed_token_ids holds only stop tokens, which min_tokens bans: nothing could be drawn")
        self.rules = rules
        self.num_output = 0
        self.counts = torch.zeros(vocab_size, device=device)  # [V] float32 occurrences in the output
        self.seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)  # [V] in the prompt or the output
        self.seen[torch.tensor(prompt_ids, dtype=torch.int64, device=device)] = True
        self.seen_ids = self.seen.nonzero()[:, 0]  # [C] the tokens seen, sorted
        self.bias = None  # [V] float32, or None without logit_bias
        if rules.logit_bias:
            self.bias = torch.zeros(vocab_size, device=device)
            for token, value in rules.logit_bias:
                self.bias[token] = value
        self.stop_ids = torch.tensor(sorted(t for t in stop_ids if t < vocab_size), dtype=torch.int64, device=device)
        self.banned = None  # [V] bool: outside allowed_token_ids, or None when every token is allowed
        if rules.allowed:
            self.banned = torch.ones(vocab_size, dtype=torch.bool, device=device)
            self.banned[torch.tensor(rules.allowed, dtype=torch.int64, device=device)] = False
        # the last tokens of prompt + output that a bad word's prefix may end with
        self.keep = max((len(w) for w in rules.bad_words), default=1) - 1
        self.tail = list(prompt_ids[-self.keep:]) if self.keep else []

    def extend(self, tokens: list[int]) -> None:
        """Committed output tokens."""
        if tokens:
            self.num_output += len(tokens)
            ids = torch.tensor(tokens, dtype=torch.int64, device=self.counts.device)
            self.counts.index_put_((ids,), torch.ones(len(tokens), device=ids.device), accumulate=True)
            self.seen[ids] = True
            self.seen_ids = self.seen.nonzero()[:, 0]
            if self.keep:
                self.tail = (self.tail + list(tokens))[-self.keep:]

    def bad_word_ends(self, path: list[int]) -> list[int]:
        """The tokens bad words ban after the history followed by `path` (draft tokens): each word's last
        token, where that context ends with the rest of the word."""
        context = self.tail + path
        return [w[-1] for w in self.rules.bad_words
                if len(w) == 1 or (len(context) >= len(w) - 1 and context[len(context) - len(w) + 1:] == list(w[:-1]))]

    def apply(self, logits: torch.Tensor, layout: TreeLayout | None, row: int = 0) -> torch.Tensor:
        """logits [T, V] at request `row`'s layout positions -> new float32 logits [T, V], each position
        under the history followed by the draft tokens on its path (the root is the history's last
        token; a node's own token is part of its context). A root alone (T = 1) needs no layout."""
        r = self.rules
        T = logits.shape[0]
        out = logits.float().clone()
        if r.min_tokens > self.num_output and self.stop_ids.numel():
            # the token drawn at a position of depth d is output token num_output + d
            depth = layout.depth[row, :T].to(out.device) if T > 1 else torch.zeros(1, dtype=torch.int64, device=out.device)
            early = (self.num_output + depth) < r.min_tokens  # [T]
            out[:, self.stop_ids] = out[:, self.stop_ids].masked_fill(early[:, None], BANNED_LOGIT)
        if self.banned is not None:
            out.masked_fill_(self.banned, BANNED_LOGIT)
        if r.bad_words:
            for t, path in enumerate(_draft_paths(layout, row, T)):
                ends = self.bad_word_ends(path)
                if ends:
                    out[t, ends] = BANNED_LOGIT
        if self.bias is not None:
            out += self.bias
        if r.presence != 0 or r.frequency != 0 or r.repetition != 1:
            self._penalize(out, layout, row)
        return out

    def apply_draft(self, logits: torch.Tensor, vocab: torch.Tensor, paths: list[list[int]]) -> torch.Tensor:
        """The same rules on a drafter's logits [F, V_draft] (draft column j is target token vocab[j])
        after each token path from the committed output: the drafter then proposes from a
        distribution closer to the one the target verifies with (drafting never changes the output)."""
        r, F = self.rules, logits.shape[0]
        out = logits.float().clone()
        if r.min_tokens > self.num_output and self.stop_ids.numel():
            early = torch.tensor([self.num_output + len(p) < r.min_tokens for p in paths], device=out.device)
            stop_cols = torch.isin(vocab, self.stop_ids)
            out[:, stop_cols] = out[:, stop_cols].masked_fill(early[:, None], BANNED_LOGIT)
        if self.banned is not None:
            out.masked_fill_(self.banned[vocab], BANNED_LOGIT)
        for f, path in enumerate(paths if r.bad_words else ()):
            ends = self.bad_word_ends(path)
            if ends:
                out[f] = out[f].masked_fill(torch.isin(vocab, torch.tensor(ends, device=vocab.device)), BANNED_LOGIT)
        if self.bias is not None:
            out += self.bias[vocab]
        if r.presence == 0 and r.frequency == 0 and r.repetition == 1:
            return out
        extra = torch.zeros(F, self.counts.numel(), device=out.device)  # [F, V] path tokens' counts
        rows = [i for i, p in enumerate(paths) for _ in p]
        if rows:
            tokens = torch.tensor([t for p in paths for t in p], device=out.device)
            extra.index_put_((torch.tensor(rows, device=out.device), tokens), torch.ones(len(rows), device=out.device),
                             accumulate=True)
        extra = extra[:, vocab]
        return self._penalty_ops(out, self.counts[vocab][None] + extra, self.seen[vocab][None] | (extra > 0))

    def _penalize(self, out: torch.Tensor, layout: TreeLayout | None, row: int) -> None:
        """The penalties, in place on out [T, V]. They change only the columns of tokens some position's
        context holds (the prompt's and output's, and each path's draft tokens): computed on those C
        columns alone, the same float ops as over the whole vocabulary, a fraction of the work."""
        T = out.shape[0]
        cols = self.seen_ids  # [C] sorted token ids
        if T > 1:
            path = layout.paths[row, :T, 1:]  # [T, D] positions of the nodes on each path (depth >= 1), -1 pad
            on_path = path >= 0
            tokens = layout.token_ids[row][path.clamp(min=0)]  # [T, D]
            cols = torch.unique(torch.cat([cols, tokens[on_path]]))
        sub = out[:, cols]  # [T, C]
        counts, seen = self.counts[cols][None], self.seen[cols][None]  # [1, C]
        if T > 1:
            extra = torch.zeros_like(sub).scatter_add_(1, torch.searchsorted(cols, tokens), on_path.float())
            counts, seen = counts + extra, seen | (extra > 0)  # [T, C]
        out[:, cols] = self._penalty_ops(sub, counts, seen)

    def _penalty_ops(self, logits: torch.Tensor, counts: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
        """Repetition, frequency and presence penalties on logits [R, C], given each row's counts of
        the C tokens in the output (and path) and whether the context holds them ([R or 1, C])."""
        r = self.rules
        if r.repetition != 1:
            logits = torch.where(seen, torch.where(logits > 0, logits / r.repetition, logits * r.repetition), logits)
        if r.frequency != 0:
            logits = logits - r.frequency * counts
        if r.presence != 0:
            logits = logits - r.presence * (counts > 0).float()
        return logits
