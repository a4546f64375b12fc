"""`SamplingParams`: how one request samples, validated on construction (vLLM's names and rules).

    SamplingParams(max_tokens=64, temperature=0.8, top_p=0.95, seed=1, n=2, stop=["\\n\\n"])
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .config import is_int as _is_int
from .core.logit_rules import LogitRules
from .core.logprobs import MAX_LOGPROBS
from .core.sampling import SamplingConfig
from .engine.structured import StructuredOutput

__all__ = ["SamplingParams"]


@dataclass(frozen=True)
class SamplingParams:
    """How to sample (validated on construction)."""

    max_tokens: int = 64
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None  # per-request generator seed; None = nondeterministic
    # Stop strings: the output's tokens end with the one that completed a stop string, its text where the
    # stop string begins (OpenAI's and vLLM's rule), or where it ends with include_stop_str_in_output.
    stop: tuple[str, ...] | str | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    skip_special_tokens: bool = True  # the text leaves out special tokens (eos, chat markers); False keeps them
    # Report each output token's logprob under the target (raw logits: before temperature, top-k and top-p)
    # and this many most likely alternatives (0: none); None: off. RequestOutput.logprobs holds them.
    logprobs: int | None = None
    # The same for every prompt token after the first (RequestOutput.prompt_logprobs): the prefill keeps
    # every position's logits (a [L, V] block) and reuses no cached prefix.
    prompt_logprobs: int | None = None
    # Logit rules (core/logit_rules.py), each position of a tree under its own context: OpenAI's presence /
    # frequency penalties ([-2, 2], on the output's tokens), vLLM's / transformers' repetition penalty (> 0,
    # 1 = off; on the prompt's and the output's tokens), OpenAI's logit_bias ({token id: [-100, 100]}), and
    # vLLM's min_tokens (eos and stop_token_ids are not drawn before the output holds this many).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | tuple[tuple[int, float], ...] | None = None
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] | None = None  # more tokens that end the output (kept), also with ignore_eos
    allowed_token_ids: tuple[int, ...] | None = None  # vLLM's: only these tokens may be drawn (None: all; [] refused)
    bad_words: tuple[str, ...] | None = None  # vLLM's: words never completed (as tokenized alone and after a space)
    min_p: float = 0.0  # keep tokens with probability >= min_p * the most likely one's (after top-k); 0 = off
    # The output must match this (JSON, a JSON schema, a regex, a choice, an EBNF grammar; engine/structured.py):
    # e.g. StructuredOutput.of(json_schema={...}). Needs xgrammar and ends at the model's eos.
    structured: StructuredOutput | None = None
    # vLLM's n: completions per prompt (RequestOutput.outputs[0..n-1]), each a request of its own; with a
    # seed, completion i samples with seed + i (vLLM's rule), so each is reproducible alone.
    n: int = 1

    def __post_init__(self) -> None:
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be a positive integer (completions per prompt), got {self.n!r}")
        if self.seed is not None and self.n > 1 and _is_int(self.seed) and self.seed + self.n > 2**64:
            raise ValueError(f"seed + n must stay below 2**64 (completion i samples with seed + i), got seed "
                             f"{self.seed} and n {self.n}")
        for name in ("logprobs", "prompt_logprobs"):
            n = getattr(self, name)
            if n is not None and not (_is_int(n) and 0 <= n <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be None or an integer in [0, {MAX_LOGPROBS}], got {n!r}")
        if self.seed is not None and not (_is_int(self.seed) and 0 <= self.seed < 2**64):
            # torch.Generator.manual_seed takes 64 bits; a larger seed used to fail only after the model loaded
            raise ValueError(f"seed must be an integer in [0, 2**64) or None, got {self.seed!r}")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif self.stop is not None:
            object.__setattr__(self, "stop", tuple(self.stop))
        if self.stop and any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop strings must be non-empty strings, got {self.stop!r}")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if isinstance(self.logit_bias, dict):  # a hashable, ordered form (and the dict's keys checked as ints)
            object.__setattr__(self, "logit_bias", tuple(sorted(self.logit_bias.items(), key=lambda kv: str(kv[0]))))
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise ValueError(f"structured must be a StructuredOutput (StructuredOutput.of(...)), got "
                             f"{type(self.structured).__name__}")
        if self.structured is not None and (self.ignore_eos or self.min_tokens):
            # a complete grammar allows only eos, which these would forbid: nothing could be drawn
            raise ValueError("structured output ends at the model's eos: it cannot be used with ignore_eos or "
                             "min_tokens")
        if self.allowed_token_ids is not None:
            given = self.allowed_token_ids
            ids = tuple(given) if isinstance(given, (list, tuple, set, frozenset, range)) else None
            if ids is None or not all(_is_int(t) and t >= 0 for t in ids):
                raise ValueError(f"allowed_token_ids must be a list of token ids >= 0, got {given!r}")
            if not ids:  # vLLM refuses it too ("allowed_token_ids is not None and empty!")
                raise ValueError("allowed_token_ids is empty: no token could be drawn (None allows every token)")
            object.__setattr__(self, "allowed_token_ids", tuple(sorted(set(ids))))
            if self.structured is not None:  # each restricts the tokens: a grammar's next one might not be allowed
                raise ValueError("allowed_token_ids cannot be combined with structured output")
        if self.bad_words is not None:
            words = (self.bad_words,) if isinstance(self.bad_words, str) else tuple(self.bad_words)
            if not all(isinstance(w, str) and w.strip() for w in words):
                raise ValueError(f"bad_words must be non-empty strings, got {self.bad_words!r}")
            object.__setattr__(self, "bad_words", words or None)
        if self.stop_token_ids is not None:
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
            if any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
                raise ValueError(f"stop_token_ids must be token ids >= 0, got {self.stop_token_ids!r}")
        for name in ("temperature", "top_p"):
            if not isinstance(getattr(self, name), (int, float)) or isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a number, got {getattr(self, name)!r}")
        if not _is_int(self.top_k):
            raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        self.config()  # validates the ranges of temperature / top_k / top_p / min_p
        self.logit_rules()

    def completions(self) -> list["SamplingParams"]:
        """The n requests of one prompt: n = 1 each, completion i seeded with seed + i (vLLM's rule)."""
        if self.n == 1:
            return [self]
        return [replace(self, n=1, seed=None if self.seed is None else self.seed + i) for i in range(self.n)]

    def logit_rules(self) -> LogitRules:
        """The request's logit rules (penalties, bias, min_tokens, allowed ids) for the engine."""
        return LogitRules(self.presence_penalty, self.frequency_penalty, self.repetition_penalty,
                          tuple(self.logit_bias or ()), self.min_tokens, self.allowed_token_ids or ())

    def config(self) -> SamplingConfig:
        """The sampling rule (temperature, top-k, top-p, min-p) for the engine."""
        if not isinstance(self.min_p, (int, float)) or isinstance(self.min_p, bool):
            raise ValueError(f"min_p must be a number, got {self.min_p!r}")
        return SamplingConfig(temperature=float(self.temperature), top_k=int(self.top_k), top_p=float(self.top_p),
                              min_p=float(self.min_p))
