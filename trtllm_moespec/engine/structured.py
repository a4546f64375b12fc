"""Structured output (JSON, a JSON schema, a regex, a choice, an EBNF grammar), lossless over trees.

A grammar allows, after each prefix of the output, a set of next tokens; the others get
`BANNED_LOGIT` (core/logit_rules.py) before the acceptance rule. As with the other logit rules,
every layout position is masked under its own context: the grammar state after the committed
output and the draft tokens on the position's path. A draft token the grammar forbids is banned at
its parent, so the acceptance rule never reaches it (its own mask is never read). Plain decoding
with the same grammar therefore emits the same tokens (greedy) or distribution (sampling).

The grammars are compiled and matched by xgrammar (an optional dependency: `pip install
'trtllm-moespec[structured]'`), imported on first use. Its `traverse_draft_tree` fills a tree's
masks in one call; `tree_masks_reference` does the same with one grammar step per path token, and
the tests check that they agree.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..core.layout import TreeLayout
from ..core.logit_rules import BANNED_LOGIT

KINDS = ("json", "json_schema", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutput:
    """What the output must match: `kind` one of KINDS and its `spec` (json: unused; json_schema: the
    schema as a JSON string; regex: the pattern; choice: the allowed strings; grammar: EBNF text)."""

    kind: str
    spec: str | tuple[str, ...] = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"structured output kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.kind == "choice":
            if not (isinstance(self.spec, tuple) and self.spec and all(isinstance(c, str) and c for c in self.spec)):
                raise ValueError(f"a choice needs a non-empty list of non-empty strings, got {self.spec!r}")
        elif self.kind != "json" and not (isinstance(self.spec, str) and self.spec):
            raise ValueError(f"structured output {self.kind} needs a non-empty string, got {self.spec!r}")
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.spec)
            except ValueError as e:
                raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
            if not isinstance(schema, dict):
                raise ValueError("the JSON schema must be a JSON object")

    @staticmethod
    def of(json_object: bool = False, json_schema: str | dict | None = None, regex: str | None = None,
           choice: list[str] | tuple[str, ...] | None = None, grammar: str | None = None) -> "StructuredOutput | None":
        """The one constraint given (None when none is): OpenAI's json_object / json_schema, vLLM's
        guided_regex / guided_choice / guided_grammar."""
        given = [(k, v) for k, v in (("json", json_object or None), ("json_schema", json_schema), ("regex", regex),
                                     ("choice", choice), ("grammar", grammar)) if v is not None]
        if len(given) > 1:
            raise ValueError(f"give one structured output constraint, got {', '.join(k for k, _ in given)}")
        if not given:
            return None
        kind, value = given[0]
        if kind == "json":
            return StructuredOutput("json")
        if kind == "json_schema" and isinstance(value, dict):
            value = json.dumps(value)
        if kind == "choice":
            value = tuple(value) if isinstance(value, (list, tuple)) else value
        return StructuredOutput(kind, value)


def _xgrammar():
    try:
        import xgrammar
    except ImportError:
        raise ValueError("structured output needs xgrammar: pip install 'trtllm-moespec[structured]'") from None
    return xgrammar


class GrammarCompiler:
    """Compiles StructuredOutputs for one tokenizer and vocabulary (compiled grammars are cached by
    xgrammar). `stop_ids` are the tokens that end a complete output (the model's eos)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: frozenset[int]):
        if tokenizer is None:
            raise ValueError("structured output needs a tokenizer; this model has none")
        xgr = _xgrammar()
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_ids))
        self._compiler = xgr.GrammarCompiler(info)
        self.vocab_size = vocab_size

    def compile(self, output: StructuredOutput) -> Any:
        c = self._compiler
        try:
            # Whitespace between JSON tokens is limited to a single space, as in compact JSON: left
            # free, small models fill the object with newlines until max_tokens.
            if output.kind == "json":  # any JSON object (OpenAI's json_object)
                return c.compile_json_schema('{"type": "object"}', strict_mode=False, any_whitespace=False)
            if output.kind == "json_schema":
                return c.compile_json_schema(output.spec, any_whitespace=False)
            if output.kind == "regex":
                return c.compile_regex(output.spec)
            if output.kind == "choice":
                return c.compile_grammar("root ::= " + " | ".join(_ebnf_string(s) for s in output.spec))
            return c.compile_grammar(output.spec)
        except RuntimeError as e:  # xgrammar's parse errors, "[time] source.cc:line: message"
            message = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", str(e).splitlines()[0])
            raise ValueError(f"cannot compile the {output.kind} constraint: {message}") from None

    def matcher(self, output: StructuredOutput) -> "GrammarState":
        return GrammarState(self.compile(output), self.vocab_size)


def _ebnf_string(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)  # a double-quoted string with JSON escapes, which EBNF reads alike


class GrammarState:
    """One request's grammar matcher: advanced by committed tokens, asked for a tree's masks."""

    def __init__(self, compiled: Any, vocab_size: int):
        xgr = _xgrammar()
        self._xgr = xgr
        self.matcher = xgr.GrammarMatcher(compiled)  # (rollback, which a tree's paths need, is unbounded)
        self.vocab_size = vocab_size

    def extend(self, tokens: list[int]) -> None:
        """Committed output tokens (each allowed: the masks let no other through)."""
        for t in tokens:
            if not self.matcher.accept_token(t):
                raise RuntimeError(f"the grammar refused committed token {t}: masks and acceptance disagree")

    def apply(self, logits: torch.Tensor, layout: TreeLayout | None, row: int = 0) -> torch.Tensor:
        """logits [T, V] at request `row`'s layout positions -> the same with the tokens the grammar
        forbids after each position's context banned."""
        allowed = self.tree_masks(layout, row, logits.shape[0]).to(logits.device)
        # logit + 0 where allowed, + BANNED_LOGIT (which absorbs any logit) where not: the same values as a
        # masked_fill, without its branch per element (5-10x slower on a grammar's irregular masks)
        return logits + allowed.float().sub_(1).mul_(-BANNED_LOGIT)

    def allowed_after(self, paths: list[list[int]]) -> torch.Tensor:
        """[len(paths), V] bool: the tokens allowed after each token path (from the committed output;
        a path the grammar refuses allows nothing). What the drafter may propose at a tree node."""
        bitmask = self._xgr.allocate_token_bitmask(len(paths), self.vocab_size)
        for i, path in enumerate(paths):
            accepted = 0
            for t in path:
                if not self.matcher.accept_token(t):
                    break
                accepted += 1
            if accepted == len(path):
                self.matcher.fill_next_token_bitmask(bitmask, i)
            else:
                bitmask[i] = 0
            if accepted:
                self.matcher.rollback(accepted)
        return unpack_bitmask(bitmask, self.vocab_size)

    def apply_draft(self, logits: torch.Tensor, vocab: torch.Tensor, paths: list[list[int]]) -> torch.Tensor:
        """A drafter's logits [F, V_draft] (draft column j is target token vocab[j]) with the tokens the
        grammar forbids after each path banned."""
        allowed = self.allowed_after(paths)[:, vocab.cpu()].to(logits.device)
        return logits + allowed.float().sub_(1).mul_(-BANNED_LOGIT)

    def tree_masks(self, layout: TreeLayout | None, row: int, T: int) -> torch.Tensor:
        """[T, V] bool: the tokens allowed after each layout position (xgrammar's tree traversal)."""
        bitmask = self._xgr.allocate_token_bitmask(T, self.vocab_size)
        if T == 1:
            self.matcher.fill_next_token_bitmask(bitmask, 0)
        else:
            first_child, next_sibling = _tree_links(layout.parent_pos[row, :T].tolist())
            self.matcher.traverse_draft_tree(torch.tensor(first_child), torch.tensor(next_sibling),
                                             layout.token_ids[row, :T].cpu(), bitmask)
        return unpack_bitmask(bitmask, self.vocab_size)

    def tree_masks_reference(self, layout: TreeLayout | None, row: int, T: int) -> torch.Tensor:
        """`tree_masks` by hand: each position's path walked by `allowed_after` (pads allow nothing:
        never read)."""
        if T == 1:
            return self.allowed_after([[]])
        parents, tokens = layout.parent_pos[row, :T].tolist(), layout.token_ids[row, :T].tolist()
        paths, pads = [], []
        for p in range(T):
            path, q = [], p
            while q > 0:
                path.append(tokens[q])
                q = parents[q]
            paths.append(path[::-1])
            pads.append(p > 0 and parents[p] < 0)
        masks = self.allowed_after(paths)
        masks[torch.tensor(pads)] = False
        return masks


def _tree_links(parents: list[int]) -> tuple[list[int], list[int]]:
    """Layout parents [T] (-1 for the root and pads) -> (first child, next sibling) per position, -1 for none."""
    T = len(parents)
    first_child, next_sibling, last_child = [-1] * T, [-1] * T, [-1] * T
    for p in range(1, T):
        parent = parents[p]
        if parent < 0:
            continue
        if first_child[parent] < 0:
            first_child[parent] = p
        else:
            next_sibling[last_child[parent]] = p
        last_child[parent] = p
    return first_child, next_sibling


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """xgrammar's int32 bitmask [T, ceil(V / 32)] (bit j of word w: token 32 w + j) -> bool [T, V]
    (numpy's unpackbits over the little-endian bytes: 4x faster than shifts in torch)."""
    bits = np.unpackbits(bitmask.contiguous().numpy().view(np.uint8), bitorder="little")
    return torch.from_numpy(bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].view(np.bool_))
