"""Tree verification: greedy == argmax chain, vectorised == reference, and losslessness
(exact enumeration of the rule, and a seeded chi-square test of the implementation against an
independently written target law)."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trtllm_moespec.core import (DraftTree, SamplingConfig, build_layout, draw_uniforms, score_order,
                                 top_k_nodes, verify_tree, verify_tree_reference)

from tests.engine.distribution import chi_square_limit, reference_law

from .strategies import random_tree, seeds

V = 4
MAX_DEPTH = 3


class TargetTable:
    """A random target LM over V tokens: p(. | context) for every context, with some zeros."""

    def __init__(self, seed: int, zero_frac: float = 0.3):
        self.seed, self.zero_frac, self.cache = seed, zero_frac, {}

    def probs(self, ctx: tuple) -> np.ndarray:
        if ctx not in self.cache:
            rng = np.random.default_rng([self.seed, len(ctx), *ctx])
            p = rng.dirichlet(np.ones(V) * 0.7)
            p[rng.random(V) < self.zero_frac] = 0.0
            if p.sum() == 0:
                p[rng.integers(V)] = 1.0
            self.cache[ctx] = p / p.sum()
        return self.cache[ctx]

    def logits(self, ctx: tuple) -> np.ndarray:
        p = self.probs(ctx)
        return np.where(p > 0, np.log(np.maximum(p, 1e-300)), -1e4)


def _layout_logits(layout, b: int, table: TargetTable) -> torch.Tensor:
    rows = []
    for pos in range(layout.num_positions):
        path = [p for p in layout.paths[b, pos].tolist() if p > 0]
        ctx = tuple(int(layout.token_ids[b, p]) for p in path) if layout.valid[b, pos] else ()
        rows.append(table.logits(ctx))
    return torch.tensor(np.stack(rows), dtype=torch.float32)


def _small_tree(rng, max_nodes=7):
    """Random tree over V tokens with depth <= MAX_DEPTH and distinct siblings."""
    while True:
        tree = random_tree(rng, 1, int(rng.integers(0, max_nodes + 1)), vocab=V)
        if tree.num_nodes == 0 or int(tree.depth.max()) <= MAX_DEPTH:
            return tree


def _exact_emission(layout, table: TargetTable) -> dict[tuple, float]:
    """Probability of each emitted sequence under the rule, by enumeration (no sampling)."""
    parent = layout.parent_pos[0].tolist()
    valid = layout.valid[0].tolist()

    def walk(pos: int, ctx: tuple) -> dict[tuple, float]:
        r = table.probs(ctx).copy()
        out: dict[tuple, float] = {}
        reach = 1.0
        for child in [j for j in range(layout.num_positions) if valid[j] and parent[j] == pos]:
            tok = int(layout.token_ids[0, child])
            acc = r[tok] / r.sum() if r.sum() > 0 else 0.0
            if acc > 0:
                for seq, q in walk(child, ctx + (tok,)).items():
                    out[(tok,) + seq] = out.get((tok,) + seq, 0.0) + reach * acc * q
            reach *= 1.0 - acc
            r[tok] = 0.0
        for tok in range(V):
            if r[tok] > 0:
                out[(tok,)] = out.get((tok,), 0.0) + reach * r[tok] / r.sum()
        return out

    return walk(0, ())


def _extend(dist: dict[tuple, float], table: TargetTable, length: int) -> dict[tuple, float]:
    """Continue every sequence with the target until `length` tokens (plain decoding)."""
    out: dict[tuple, float] = {}
    for seq, q in dist.items():
        stack = [(seq, q)]
        while stack:
            s, w = stack.pop()
            if len(s) >= length:
                out[s[:length]] = out.get(s[:length], 0.0) + w
                continue
            for tok, p in enumerate(table.probs(s)):
                if p > 0:
                    stack.append((s + (tok,), w * p))
    return out


@settings(max_examples=60, deadline=None)
@given(seeds)
def test_rule_is_lossless_by_exact_enumeration(seed):
    rng = np.random.default_rng(seed)
    table = TargetTable(seed)
    tree = _small_tree(rng)
    layout = build_layout(tree, top_k_nodes(tree, tree.num_nodes), torch.tensor([0]))
    got = _extend(_exact_emission(layout, table), table, MAX_DEPTH + 1)
    want = _extend({(): 1.0}, table, MAX_DEPTH + 1)
    assert set(got) <= set(want)
    for seq, p in want.items():
        assert math.isclose(got.get(seq, 0.0), p, abs_tol=1e-12)


@settings(max_examples=50, deadline=None)
@given(seeds, st.sampled_from([0, 8]))
def test_vectorised_equals_reference_with_the_same_uniforms(seed, host_walk_max_batch):
    """Both sampling walks (the vectorised one the GPU and large CPU batches run: host_walk_max_batch
    0; the host walk of small CPU batches: 8) accept what the reference does, with the same uniforms."""
    import trtllm_moespec.core.verify as verify

    verify.HOST_WALK_MAX_BATCH, saved = host_walk_max_batch, verify.HOST_WALK_MAX_BATCH
    try:
        _check_against_reference(seed)
    finally:
        verify.HOST_WALK_MAX_BATCH = saved


def _check_against_reference(seed):
    rng = np.random.default_rng(seed)
    B = 3
    tree = random_tree(rng, B, int(rng.integers(0, 12)), vocab=8)
    layout = build_layout(tree, top_k_nodes(tree, int(rng.integers(0, 12))), torch.tensor([1, 2, 3]))
    logits = torch.randn(B, layout.num_positions, 8, generator=torch.Generator().manual_seed(seed))
    configs = [SamplingConfig(), SamplingConfig(temperature=0.8, top_k=3), SamplingConfig(temperature=1.3, top_p=0.7)]
    u = draw_uniforms(B, layout.num_positions, [torch.Generator().manual_seed(seed + b) for b in range(B)])
    fast = verify_tree(layout, logits, configs, uniforms=u)
    slow = verify_tree_reference(layout, logits, configs, u)
    for name in ("accepted_pos", "num_accepted", "emitted_ids", "num_emitted"):
        assert torch.equal(getattr(fast, name), getattr(slow, name)), name


@settings(max_examples=50, deadline=None)
@given(seeds)
def test_greedy_verification_follows_the_argmax_chain(seed):
    rng = np.random.default_rng(seed)
    tree = random_tree(rng, 2, int(rng.integers(0, 14)), vocab=5)
    layout = build_layout(tree, top_k_nodes(tree, 14), torch.tensor([0, 0]))
    logits = torch.randn(2, layout.num_positions, 5, generator=torch.Generator().manual_seed(seed))
    res = verify_tree(layout, logits, [SamplingConfig()] * 2)
    for b in range(2):
        pos, chain = 0, []
        while True:
            want = int(logits[b, pos].argmax())
            nxt = [j for j in range(layout.num_positions)
                   if layout.valid[b, j] and int(layout.parent_pos[b, j]) == pos and int(layout.token_ids[b, j]) == want]
            if not nxt:
                chain.append(want)
                break
            chain.append(want)
            pos = nxt[0]
        n = int(res.num_emitted[b])
        assert res.emitted_ids[b, :n].tolist() == chain


def _chi_square(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    keep = probs > 0
    assert counts[~keep].sum() == 0, "a zero-probability sequence was emitted"
    n = counts.sum()
    exp = probs[keep] * n
    return float(((counts[keep] - exp) ** 2 / exp).sum()), int(keep.sum() - 1)


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 3, 1.0), (1.4, 0, 0.75)])
def test_sampling_distribution_matches_an_independent_target_law(temperature, top_k, top_p):
    """Implementation check: emitted (x1, x2) frequencies over 20k seeded trials against the exact
    target, built by the separately written rule of tests/engine/distribution.py (not target_probs)."""
    rng = np.random.default_rng(123)
    table = TargetTable(7, zero_frac=0.2)
    # Hand-built tree: a zero-probability sibling, a deep branch, and a leaf at max depth.
    tokens = torch.tensor([[0, 1, 2, 3, 0, 1, 2]])
    parents = torch.tensor([[-1, -1, -1, 0, 0, 3, 1]])
    tree = DraftTree.from_parents(tokens, parents, torch.full((1, 7), 0.5))
    layout = build_layout(tree, score_order(tree), torch.tensor([0]))
    logits = _layout_logits(layout, 0, table)
    cfg = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p)
    cache = {}

    def p_of(ctx):
        if ctx not in cache:
            cache[ctx] = reference_law(table.logits(ctx), temperature, top_k, top_p)
        return cache[ctx]

    trials = 20000
    B = trials
    lay = build_layout(DraftTree(*(getattr(tree, f).expand(B, -1) for f in ("token_ids", "parents", "depth", "draft_probs", "log_scores", "valid"))),
                       score_order(tree).expand(B, -1), torch.zeros(B, dtype=torch.long))
    u = torch.rand(B, lay.num_positions + 1, generator=torch.Generator().manual_seed(2024), dtype=torch.float64)
    res = verify_tree(lay, logits.expand(B, -1, -1), [cfg] * B, uniforms=u)
    assert int(res.num_accepted.sum()) > trials // 4  # the tree's nodes are accepted, not only bonus tokens drawn
    if temperature == 1.0:  # the host walk (CPU batches of <= 8) on the same trials: the same outcomes
        host = [verify_tree(_rows(lay, b, b + 8), logits.expand(8, -1, -1), [cfg] * 8, uniforms=u[b:b + 8])
                for b in range(0, 4000, 8)]
        assert torch.equal(torch.cat([h.emitted_ids for h in host]), res.emitted_ids[:4000])
    counts = np.zeros(V * V)
    emitted = res.emitted_ids.numpy()
    for b in range(B):
        x1 = emitted[b, 0]
        x2 = emitted[b, 1] if res.num_emitted[b] >= 2 else rng.choice(V, p=p_of((int(x1),)))
        counts[x1 * V + x2] += 1
    probs = np.array([p_of(())[a] * p_of((a,))[c] for a in range(V) for c in range(V)])
    stat, dof = _chi_square(counts, probs)
    # The seed is fixed, so this is deterministic.
    assert stat < chi_square_limit(dof), (stat, dof, chi_square_limit(dof))


def _rows(layout, start: int, end: int):
    """Requests start..end of a batched layout."""
    from dataclasses import fields, replace

    return replace(layout, **{f.name: getattr(layout, f.name)[start:end] for f in fields(layout)
                              if isinstance(getattr(layout, f.name), torch.Tensor)})


def test_non_finite_logits_raise():
    tree = random_tree(np.random.default_rng(0), 1, 3, pad=False)
    layout = build_layout(tree, score_order(tree), torch.tensor([0]))
    logits = torch.zeros(1, 4, 5)
    logits[0, 0, 1] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        verify_tree(layout, logits, [SamplingConfig(temperature=1.0)])
    with pytest.raises(ValueError, match="SamplingConfig"):
        verify_tree(layout, torch.zeros(1, 4, 5), [])


@pytest.mark.parametrize("kwargs", [{"temperature": -1.0}, {"temperature": float("nan")}, {"top_k": -1},
                                    {"top_p": 0.0}, {"top_p": 1.5}, {"top_k": 1.5}])
def test_invalid_sampling_config(kwargs):
    with pytest.raises(ValueError):
        SamplingConfig(**kwargs)


@settings(max_examples=60, deadline=None)
@given(seeds)
def test_host_greedy_walk_equals_the_tensor_path(seed):
    """CPU greedy verification walks on host lists; it must return exactly the tensor path's result."""
    from trtllm_moespec.core.verify import _greedy_tree, _greedy_tree_host

    rng = np.random.default_rng(seed)
    B = int(rng.integers(1, 4))
    tree = random_tree(rng, B, int(rng.integers(0, 16)), vocab=3)  # small vocab: long accepted chains
    layout = build_layout(tree, top_k_nodes(tree, int(rng.integers(0, 16))), torch.arange(B))
    logits = torch.randn(B, layout.num_positions, 3, generator=torch.Generator().manual_seed(seed))
    host, tensors = _greedy_tree_host(layout, logits), _greedy_tree(layout, logits)
    for name in ("accepted_pos", "num_accepted", "emitted_ids", "num_emitted"):
        assert torch.equal(getattr(host, name), getattr(tensors, name)), name
