"""The compiled node values (core/values_host.py) against the numpy path they replace: the same groups,
the same values up to float rounding, the same online counts after every step; the compiled isotonic fit
against the reference one; and a tree whose parents do not come first falls back to numpy."""

from unittest.mock import patch

import numpy as np
import pytest
import torch
from hypothesis import given, settings

from trtllm_moespec.core import DraftTree, SamplingConfig
from trtllm_moespec.core import values as values_mod
from trtllm_moespec.core.values import CalibratedValues, Calibrator, isotonic_fit
from trtllm_moespec.core.values_host import compiled_values

from .strategies import random_eagle_tree, random_tree, seeds

pytest.importorskip("numba")


def _numpy_path():
    """A context in which node values take the numpy path."""
    return patch.object(values_mod, "compiled_values", lambda: None)


def _random_calibrator(rng: np.random.Generator) -> Calibrator:
    cal = Calibrator(num_depths=3, num_ranks=3)
    n = 4000
    group = rng.integers(0, cal.num_groups, n)
    score = rng.uniform(0, 1, n)
    hit = (rng.uniform(0, 1, n) < np.sqrt(score)).astype(np.float64)
    return cal.fit({0.0: (group, score, hit)}, source="test")


def _with_ties(tree: DraftTree, rng: np.random.Generator) -> DraftTree:
    """Siblings with equal q (rank ties go to the lower index) and some padded nodes."""
    q = tree.draft_probs.clone()
    q[:, 1::3] = q[:, ::3][:, : q[:, 1::3].shape[1]]
    valid = (tree.valid & torch.from_numpy(rng.uniform(0, 1, tuple(q.shape)) > 0.1))[0].tolist()
    parents = tree.parents[0].tolist()
    for v, p in enumerate(parents):  # below a padded node, everything is padding
        valid[v] = valid[v] and (p < 0 or valid[p])
    return DraftTree.from_parents(tree.token_ids, tree.parents, q, torch.tensor([valid]))


def _steps(model: CalibratedValues, trees: list[DraftTree], context: list[int]) -> list[tuple]:
    """Values, groups and the online counts after each tree, observing a made-up outcome after each (so the
    online maps move): verified nodes in value order, -1 padded, some accepted, not all of them trials."""
    state = model.for_request(SamplingConfig())
    out = []
    for i, tree in enumerate(trees):
        v = state.values(tree, None, context + [i % 7])
        groups = state._last[1].copy()
        chosen = torch.argsort(v[0], descending=True)[:6][None]
        verified = torch.cat([chosen, torch.full((1, 2), -1)], 1)
        accepted = torch.cat([chosen[:, (i % 2)::2][:, : i % 4], torch.full((1, 1), -1)], 1)
        state.observe(tree, verified, accepted)
        out.append((v, groups, state.state.trials.copy(), state.state.accepted.copy()))
    return out


@settings(max_examples=25, deadline=None)
@given(seeds)
def test_compiled_values_equal_the_numpy_path(seed):
    assert compiled_values() is not None, "numba is installed: the compiled values must be on"
    rng = np.random.default_rng(seed)
    model = CalibratedValues(_random_calibrator(rng))
    trees = [_with_ties(random_eagle_tree(rng, 1, 4, 3, vocab=12), rng) for _ in range(3)]
    trees.append(random_tree(rng, 1, 9, vocab=6))
    context = rng.integers(0, 12, 30).tolist()
    got = _steps(model, trees, context)
    with _numpy_path():
        ref = _steps(model, trees, context)
    for (v, g, trials, hits), (rv, rg, rtrials, rhits) in zip(got, ref):
        assert g.tolist() == rg.tolist()
        torch.testing.assert_close(v, rv, rtol=1e-6, atol=1e-7)
        assert np.array_equal(trials, rtrials) and np.array_equal(hits, rhits)


def test_a_child_before_its_parent_takes_the_numpy_path():
    # node 0's parent is node 1: no topological order, which the compiled loop needs
    tree = DraftTree(torch.tensor([[5, 6]]), torch.tensor([[1, -1]]), torch.tensor([[2, 1]]),
                     torch.tensor([[0.5, 0.6]]), torch.log(torch.tensor([[0.3, 0.6]])), torch.tensor([[True, True]]))
    cal = Calibrator()
    kernel = compiled_values()[0]
    groups, vals = np.empty(2, dtype=np.int64), np.empty(2, dtype=np.float32)
    assert not kernel(tree.parents[0].numpy(), tree.depth[0].numpy(), tree.draft_probs[0].numpy(),
                      tree.draft_probs[0].double().numpy(), tree.valid[0].numpy(), np.zeros(2, dtype=np.int64),
                      cal.start(0.0).maps(), np.linspace(0.025, 0.975, 18), cal.num_depths, cal.num_ranks, cal.copy,
                      groups, vals)
    model = CalibratedValues(cal)
    got = model.for_request(SamplingConfig()).values(tree, None, [1, 2, 3])
    with _numpy_path():
        ref = model.for_request(SamplingConfig()).values(tree, None, [1, 2, 3])
    assert torch.equal(got, ref)


@settings(max_examples=40, deadline=None)
@given(seeds)
def test_compiled_isotonic_equals_the_reference(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 20))
    y, w = rng.uniform(0, 1, n), rng.uniform(0.1, 3, n)
    out = np.empty(n)
    compiled_values()[1](y, w, out)
    np.testing.assert_allclose(out, isotonic_fit(y, w), rtol=1e-12, atol=1e-12)


@settings(max_examples=30, deadline=None)
@given(seeds)
def test_compiled_refit_changes_only_the_named_groups_as_the_reference_fits_them(seed):
    rng = np.random.default_rng(seed)
    G, M = int(rng.integers(1, 12)), int(rng.integers(1, 10))
    trials = rng.integers(0, 20, (G, M)).astype(np.float64) + rng.uniform(0.1, 1, (G, M))  # a prior's weight
    hits = np.floor(trials * rng.uniform(0, 1, (G, M)))
    groups = rng.choice(G, int(rng.integers(0, G + 1)), replace=False).astype(np.int64)
    maps = rng.uniform(0, 1, (G, M))
    before = maps.copy()
    compiled_values()[3](hits, trials, groups, maps)
    for g in range(G):
        want = isotonic_fit(hits[g] / np.maximum(trials[g], 1e-12), trials[g]) if g in groups else before[g]
        np.testing.assert_allclose(maps[g], want, rtol=1e-12, atol=1e-12)


def test_the_switch_turns_the_compiled_values_and_selection_off(monkeypatch):
    from trtllm_moespec.core.select_host import compiled_evict

    assert compiled_evict() is not None
    monkeypatch.setenv("MOESPEC_FUSED_VALUES", "0")
    assert compiled_values() is None and compiled_evict() is None
