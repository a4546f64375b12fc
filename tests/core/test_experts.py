"""Expert bitsets: packing, unions, popcounts."""

import numpy as np
import pytest
import torch

from trtllm_moespec.core import ExpertSets, num_words, popcount
from trtllm_moespec.core.experts import or_reduce, unique_experts_per_layer, words_to_bools


def test_pack_and_count_match_python_sets():
    rng = np.random.default_rng(0)
    L, E, k = 94, 256, 8
    ids = torch.from_numpy(np.stack([[rng.choice(E, k, replace=False) for _ in range(L)] for _ in range(5)]))[None]
    sets = ExpertSets.from_topk_ids(ids, E)
    assert sets.bits.shape == (1, 5, num_words(L, E)) == (1, 5, 376)
    for n in range(5):
        want = {l * E + int(e) for l in range(L) for e in ids[0, n, l]}
        assert set(torch.nonzero(words_to_bools(sets.bits[0, n])).flatten().tolist()) == want
    assert popcount(sets.bits).tolist() == [[L * k] * 5]
    union = or_reduce(sets.bits[0], 0)
    want = {l * E + int(e) for n in range(5) for l in range(L) for e in ids[0, n, l]}
    assert int(popcount(union)) == len(want)
    per_layer = unique_experts_per_layer(union, L, E)
    assert int(per_layer.sum()) == len(want) and per_layer.shape == (L,)


def test_negative_ids_are_ignored_and_bad_ids_rejected():
    sets = ExpertSets.from_topk_ids(torch.tensor([[[[0, -1]]]]), 4)
    assert int(popcount(sets.bits)) == 1
    with pytest.raises(ValueError, match="out of range"):
        ExpertSets.from_topk_ids(torch.tensor([[[[4]]]]), 4)
    with pytest.raises(ValueError, match=r"\[B, N, L, topk\]"):
        ExpertSets.from_topk_ids(torch.zeros(2, 3, dtype=torch.long), 4)
