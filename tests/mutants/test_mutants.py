"""The mutant harness itself (fast, in the main suite): every mutant installs on the current verifier,
changes its outcomes on random trees with the same random numbers, is counted as exercised, and is
gone after undo. A verifier refactor that a mutant no longer fits fails here first."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.core.strategies import random_tree
from tests.mutants.mutants import HITS, MUTANTS
from trtllm_moespec.core import SamplingConfig, build_layout, top_k_nodes, verify_tree
from trtllm_moespec.core.seeded import PositionKeys

VOCAB = 6


def _outcomes(batch_size: int, cfg: SamplingConfig, seeds=range(6)) -> list[torch.Tensor]:
    """Emitted ids of verify_tree on random trees and logits, with fixed uniforms (and fixed keys)."""
    out = []
    for seed in seeds:
        rng = np.random.default_rng(seed)
        tree = random_tree(rng, batch_size, 10, vocab=VOCAB)
        layout = build_layout(tree, top_k_nodes(tree, 10), torch.zeros(batch_size, dtype=torch.long))
        g = torch.Generator().manual_seed(seed)
        logits = 2 * torch.randn(batch_size, layout.num_positions, VOCAB, generator=g)
        u = torch.rand(batch_size, layout.num_positions + 1, generator=g, dtype=torch.float64)
        out.append(verify_tree(layout, logits, [cfg] * batch_size, uniforms=u).emitted_ids)
        keys = PositionKeys(tuple(range(batch_size)), (seed,) * batch_size)  # the seeded rule, at output position `seed`
        out.append(verify_tree(layout, logits, [cfg] * batch_size, seeds=keys).emitted_ids)
    return out


@pytest.mark.parametrize("batch_size", [4, 12])  # the host walk (<= 8 requests on the CPU) and the tensor walk
@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_each_mutant_changes_the_verifier_and_is_undone(name, batch_size):
    mutant = MUTANTS[name]
    cfg = SamplingConfig() if mutant.kind == "greedy" else SamplingConfig(temperature=0.7, top_p=0.8)
    clean = _outcomes(batch_size, cfg)
    patcher = pytest.MonkeyPatch()
    HITS.clear()
    mutant.apply(patcher)
    try:
        broken = _outcomes(batch_size, cfg)
    finally:
        patcher.undo()
    assert HITS[name] > 0, f"mutant {name} was never exercised"
    assert any(not torch.equal(a, b) for a, b in zip(clean, broken)), f"mutant {name} changed nothing"
    assert all(torch.equal(a, b) for a, b in zip(clean, _outcomes(batch_size, cfg)))  # undone
