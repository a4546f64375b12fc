"""TokenHistory against a plain per-position reference: on random trees, histories and rules, every
layout position's logits (and a drafter's, on a reduced vocabulary) are the ones the rules give
under that position's own context, token by token."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings

from tests.core.strategies import random_tree, seeds
from trtllm_moespec.core.layout import build_layout
from trtllm_moespec.core.logit_rules import BANNED_LOGIT, LogitRules, TokenHistory

V = 30


def reference(logits: torch.Tensor, prompt: list[int], output: list[int], rules: LogitRules,
              stop_ids: set[int]) -> torch.Tensor:
    """One position's logits [V] whose context is prompt + output (output includes the path)."""
    out = logits.clone()
    if len(output) < rules.min_tokens:
        for t in stop_ids:
            out[t] = BANNED_LOGIT
    for t, b in rules.logit_bias:
        out[t] += b
    for t in set(prompt) | set(output):
        if rules.repetition != 1:
            out[t] = out[t] / rules.repetition if out[t] > 0 else out[t] * rules.repetition
    for t in set(output):
        out[t] = out[t] - rules.frequency * output.count(t)
        out[t] = out[t] - rules.presence
    return out


def _random_case(seed: int):
    rng = np.random.default_rng(seed)
    rules = LogitRules(presence=float(rng.choice([0.0, 0.5, -1.0])), frequency=float(rng.choice([0.0, 0.7, 2.0])),
                       repetition=float(rng.choice([1.0, 1.3, 0.8])),
                       logit_bias=tuple((int(t), float(rng.uniform(-5, 5))) for t in rng.choice(V, 3, replace=False)),
                       min_tokens=int(rng.integers(0, 8)))
    prompt = rng.integers(0, V, size=int(rng.integers(1, 6))).tolist()
    output = rng.integers(0, V, size=int(rng.integers(1, 5))).tolist()  # its last token is the root
    stop_ids = {int(t) for t in rng.choice(V, 2, replace=False)}
    history = TokenHistory(rules, prompt, V, frozenset(stop_ids))
    history.extend(output)
    return rng, rules, prompt, output, stop_ids, history


@settings(max_examples=40, deadline=None)
@given(seeds)
def test_tree_positions_follow_the_reference(seed):
    rng, rules, prompt, output, stop_ids, history = _random_case(seed)
    tree = random_tree(rng, 1, int(rng.integers(0, 12)), vocab=V, pad=False)
    node_idx = torch.arange(tree.num_nodes)[None]  # every node, in index order (parents come first)
    layout = build_layout(tree, node_idx, torch.tensor([output[-1]]))
    T = layout.num_positions
    logits = torch.randn(T, V, generator=torch.Generator().manual_seed(seed)) * 4
    got = history.apply(logits, layout)
    parents, tokens = layout.parent_pos[0].tolist(), layout.token_ids[0].tolist()
    for p in range(T):
        path, q = [], p
        while q > 0:
            path.append(tokens[q])
            q = parents[q]
        want = reference(logits[p], prompt, output + path[::-1], rules, stop_ids)
        torch.testing.assert_close(got[p], want, rtol=1e-6, atol=1e-5)


@settings(max_examples=40, deadline=None)
@given(seeds)
def test_drafter_rows_follow_the_reference(seed):
    rng, rules, prompt, output, stop_ids, history = _random_case(seed)
    vocab = torch.from_numpy(np.sort(rng.choice(V, 12, replace=False)))  # a reduced draft vocabulary
    paths = [rng.integers(0, V, size=int(rng.integers(0, 4))).tolist() for _ in range(int(rng.integers(1, 5)))]
    logits = torch.randn(len(paths), len(vocab), generator=torch.Generator().manual_seed(seed)) * 4
    got = history.apply_draft(logits, vocab, paths)
    for i, path in enumerate(paths):
        full = torch.zeros(V)
        full[vocab] = logits[i]
        want = reference(full, prompt, output + path, rules, stop_ids)[vocab]
        torch.testing.assert_close(got[i], want, rtol=1e-6, atol=1e-5)
