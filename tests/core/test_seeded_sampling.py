"""The position-keyed rule of seeded requests (core/seeded.py, core/verify.py): its uniforms depend on
(key, output position) only, a tree emits exactly the tokens plain decoding emits with the same keys
(and accepts the longest drafted path that agrees with them: the most any lossless rule can), and the
emitted tokens follow an independently written target law (seeded chi-square with drafts accepted)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given, settings

from tests.engine.distribution import chi_square, chi_square_limit, reference_law
from trtllm_moespec.core import DraftTree, SamplingConfig, build_layout, score_order, top_k_nodes, verify_tree
from trtllm_moespec.core.layout import root_layout
from trtllm_moespec.core.seeded import PositionKeys, position_uniform

from .strategies import random_tree, seeds

V = 6


def _logits_of(seed: int, ctx: tuple[int, ...]) -> np.ndarray:
    """[V] logits of a random context-dependent target: some tokens impossible, the rest Dirichlet."""
    rng = np.random.default_rng([seed, len(ctx), *ctx])
    p = rng.dirichlet(np.ones(V) * 0.7)
    p[rng.random(V) < 0.25] = 0.0
    if p.sum() == 0:
        p[rng.integers(V)] = 1.0
    return np.where(p > 0, np.log(np.maximum(p, 1e-300)), -1e4)


def _layout_logits(layout, seed: int) -> torch.Tensor:
    """[B, T, V] logits at every layout position: the target's at that position's context (its path)."""
    rows = [[_logits_of(seed, tuple(int(layout.token_ids[b, p]) for p in layout.paths[b, pos].tolist() if p > 0)
                        if layout.valid[b, pos] else ())
             for pos in range(layout.num_positions)] for b in range(layout.batch_size)]
    return torch.tensor(np.array(rows), dtype=torch.float32)


def _plain_chain(seed: int, cfg: SamplingConfig, key: int, start: int, length: int) -> list[int]:
    """Tokens plain decoding (a root-only step per token) emits from the empty context with `key`."""
    out: list[int] = []
    for _ in range(length):
        logits = torch.tensor(_logits_of(seed, tuple(out)), dtype=torch.float32)[None, None]  # [1, 1, V]
        res = verify_tree(root_layout(torch.tensor([0])), logits, [cfg], seeds=PositionKeys((key,), (start + len(out),)))
        out.append(int(res.emitted_ids[0, 0]))
    return out


def _deepest_agreeing(layout, b: int, chain: list[int]) -> int:
    """Depth of the deepest valid node whose path carries chain[0..depth-1]."""
    best = 0
    for pos in range(1, layout.num_positions):
        if layout.valid[b, pos]:
            path = [int(layout.token_ids[b, p]) for p in layout.paths[b, pos].tolist() if p > 0]
            if path == chain[:len(path)]:
                best = max(best, len(path))
    return best


def test_uniforms_depend_on_key_and_position_only():
    keys = PositionKeys((3, 2**64 - 1, 3), (0, 7, 5))
    u = keys.uniforms(4)  # [3, 5]
    assert u.dtype == torch.float32 and u.shape == (3, 5)
    for b, (key, start) in enumerate(zip(keys.keys, keys.starts)):
        assert u[b].tolist() == [position_uniform(key, start + d) for d in range(5)]
    assert torch.equal(u[2], PositionKeys((3,), (0,)).uniforms(9)[0, 5:])  # the same key further on: the same numbers
    assert torch.equal(keys.uniforms(4), PositionKeys((3, 2**64 - 1, 3), (0, 7, 5)).uniforms(4))
    assert position_uniform(3, 0) != position_uniform(4, 0)


def test_uniforms_are_uniform_and_independent_across_positions_and_nearby_keys():
    """24-bit uniforms (exact in float32, below 1); chi-square of 10 bins, of (u_t, u_t+1) pairs on a
    5 x 5 grid, and of the same position under seeds s and s + 1 (a request's n completions)."""
    n = 20000
    u = np.array([[position_uniform(key, t) for t in range(2)] for key in range(n)])
    assert (u >= 0).all() and (u < 1).all() and (u * 2**24 == np.round(u * 2**24)).all()
    assert np.array_equal(u.astype(np.float32).astype(np.float64), u)
    nearby = np.stack([u[:-1, 0], u[1:, 0]], 1)  # U(s, 0) beside U(s + 1, 0)
    for cells in (np.floor(u[:, 0] * 10), np.floor(u[:, 0] * 5) * 5 + np.floor(u[:, 1] * 5),
                  np.floor(nearby[:, 0] * 5) * 5 + np.floor(nearby[:, 1] * 5)):
        counts = np.bincount(cells.astype(int))
        expected = len(cells) / len(counts)
        stat = float(((counts - expected) ** 2 / expected).sum())
        assert stat < chi_square_limit(len(counts) - 1), (stat, counts)


@pytest.mark.parametrize("keys, starts", [((1, 2), (0,)), ((-1,), (0,)), ((2**64,), (0,)), ((1.5,), (0,)),
                                          ((1,), (-1,))])
def test_bad_keys_are_refused(keys, starts):
    with pytest.raises(ValueError):
        PositionKeys(keys, starts)


def test_a_key_per_request_is_required():
    layout = root_layout(torch.tensor([0, 0]))
    with pytest.raises(ValueError, match="one sampling key per request"):
        verify_tree(layout, torch.zeros(2, 1, V), [SamplingConfig(temperature=1.0)] * 2, seeds=PositionKeys((1,), (0,)))


@settings(max_examples=40, deadline=None)
@given(seeds)
def test_every_tree_emits_the_tokens_plain_decoding_emits(seed):
    """Whatever the tree (random shapes, selections and pads) and the walk (host lists or tensors),
    the emitted tokens are the plain chain's with the same keys, and the accepted nodes are the
    deepest drafted path that agrees with it: no lossless rule accepts more."""
    import trtllm_moespec.core.verify as verify

    rng = np.random.default_rng(seed)
    B = 3
    tree = random_tree(rng, B, int(rng.integers(0, 14)), vocab=3)  # 3 of the V tokens: long agreeing paths
    layout = build_layout(tree, top_k_nodes(tree, int(rng.integers(0, 14))), torch.zeros(B, dtype=torch.long))
    logits = _layout_logits(layout, seed)
    configs = [SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.8, top_k=4),
               SamplingConfig(temperature=1.3, top_p=0.8, min_p=0.05)]
    keys = PositionKeys(tuple(int(k) for k in rng.integers(0, 2**63, B)), tuple(int(s) for s in rng.integers(0, 50, B)))
    results = []
    for host_walk_max_batch in (0, 8):  # the tensor walk, then the host walk
        verify.HOST_WALK_MAX_BATCH, saved = host_walk_max_batch, verify.HOST_WALK_MAX_BATCH
        try:
            results.append(verify_tree(layout, logits, configs, seeds=keys))
        finally:
            verify.HOST_WALK_MAX_BATCH = saved
    for name in ("accepted_pos", "num_accepted", "emitted_ids", "num_emitted"):
        assert torch.equal(getattr(results[0], name), getattr(results[1], name)), name
    res = results[0]
    for b in range(B):
        chain = _plain_chain(seed, configs[b], keys.keys[b], keys.starts[b], layout.max_depth + 1)
        n = int(res.num_emitted[b])
        assert res.emitted_ids[b, :n].tolist() == chain[:n]
        assert int(res.num_accepted[b]) == _deepest_agreeing(layout, b, chain)
        alone = verify_tree(_row(layout, b), logits[b:b + 1], [configs[b]],
                            seeds=PositionKeys((keys.keys[b],), (keys.starts[b],)))
        assert torch.equal(alone.emitted_ids, res.emitted_ids[b:b + 1, :alone.emitted_ids.shape[1]])


def _row(layout, b: int):
    """Request b of a batched layout."""
    return dataclasses.replace(layout, **{f.name: getattr(layout, f.name)[b:b + 1] for f in dataclasses.fields(layout)
                                          if isinstance(getattr(layout, f.name), torch.Tensor)})


def test_greedy_requests_ignore_their_keys():
    rng = np.random.default_rng(0)
    tree = random_tree(rng, 2, 10, vocab=3)
    layout = build_layout(tree, top_k_nodes(tree, 10), torch.zeros(2, dtype=torch.long))
    logits = _layout_logits(layout, 0)
    plain = verify_tree(layout, logits, [SamplingConfig()] * 2)
    for keys in (PositionKeys((1, 2), (0, 0)), PositionKeys((9, 9), (5, 40))):
        seeded = verify_tree(layout, logits, [SamplingConfig()] * 2, seeds=keys)
        assert torch.equal(seeded.emitted_ids, plain.emitted_ids)


@pytest.mark.parametrize("temperature, top_k, top_p, min_p",
                         [(1.0, 0, 1.0, 0.0), (0.7, 3, 1.0, 0.0), (1.4, 0, 0.75, 0.0), (1.0, 0, 1.0, 0.2)])
def test_seeded_sampling_follows_an_independent_target_law_with_drafts_accepted(temperature, top_k, top_p, min_p):
    """(x1, x2) over 20k keys against the law of tests/engine/distribution.py (not target_probs): x1 from
    the tree's root, x2 from an accepted child's sample or, when the tree emitted one token, from the
    next plain step at output position 1 (the same key's next number); drafts must be accepted."""
    seed, trials = 14, 20000  # (this target gives the root's drafted children about half its mass)
    tokens = torch.tensor([[0, 1, 2, 3, 0, 1, 2]])  # a deep branch, siblings, a leaf at depth 3
    parents = torch.tensor([[-1, -1, -1, 0, 0, 3, 1]])
    tree = DraftTree.from_parents(tokens, parents, torch.full((1, 7), 0.5))
    one = build_layout(tree, score_order(tree), torch.tensor([0]))
    layout = dataclasses.replace(one, **{f.name: getattr(one, f.name).expand(trials, *getattr(one, f.name).shape[1:])
                                         for f in dataclasses.fields(one)})  # the same tree for every trial
    cfg = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    res = verify_tree(layout, _layout_logits(one, seed).expand(trials, -1, -1), [cfg] * trials,
                      seeds=PositionKeys(tuple(range(trials)), (0,) * trials))
    law = {ctx: reference_law(_logits_of(seed, ctx), temperature, top_k, top_p, min_p) for ctx in [()] + [(a,) for a in range(V)]}
    # A root child is accepted exactly when the root's sample carries its token: with probability the
    # children's mass (the most a lossless rule can accept), 4.5 standard deviations allowed.
    mass = law[()][[0, 1, 2]].sum()
    accepted_root = float((res.num_accepted > 0).float().mean())
    assert abs(accepted_root - mass) < 4.5 * (mass * (1 - mass) / trials) ** 0.5 + 1e-9, (accepted_root, mass)
    assert int(res.num_accepted.sum()) > trials // 4  # the tree's nodes are accepted, not only bonus tokens drawn
    emitted = res.emitted_ids.numpy()
    x1 = emitted[:, 0]
    x2 = emitted[:, 1].copy()
    alone = np.flatnonzero(res.num_emitted.numpy() == 1)
    for a in range(V):  # the next plain step of the trials that emitted one token, grouped by that token
        rows = alone[x1[alone] == a]
        if len(rows):
            logits = torch.tensor(_logits_of(seed, (a,)), dtype=torch.float32).expand(len(rows), 1, V)
            nxt = verify_tree(root_layout(torch.zeros(len(rows), dtype=torch.long)), logits, [cfg] * len(rows),
                              seeds=PositionKeys(tuple(int(r) for r in rows), (1,) * len(rows)))
            x2[rows] = nxt.emitted_ids[:, 0].numpy()
    exact = {(a, c): law[()][a] * law[(a,)][c] for a in range(V) for c in range(V) if law[()][a] * law[(a,)][c] > 0}
    counts: dict[tuple[int, int], int] = {}
    for a, c in zip(x1.tolist(), x2.tolist()):
        counts[a, c] = counts.get((a, c), 0) + 1
    assert set(counts) <= set(exact), "a zero-probability sequence was emitted"
    stat, dof = chi_square(counts, exact, trials)
    assert dof >= 5 and stat < chi_square_limit(dof), (stat, dof, chi_square_limit(dof))
