"""The step statistic `unique_experts_per_layer`: distinct experts the verified tokens woke, a mean over MoE
layers, on the CPU through 64-bit masks (up to 64 experts) or a sort (more), against counting sets."""

from types import SimpleNamespace

import pytest
import torch

from trtllm_moespec.engine.engine import _unique_per_layer


@pytest.mark.parametrize("num_experts", [4, 32, 64, 128])
@pytest.mark.parametrize("tokens", [1, 2, 33])
def test_unique_experts_per_layer_counts_each_layers_distinct_experts(num_experts, tokens):
    ids = torch.randint(0, num_experts, (1, tokens, 24, 4), generator=torch.Generator().manual_seed(tokens))
    if tokens == 1:  # one token's top-k are distinct experts
        ids[0, 0] = torch.stack([torch.randperm(num_experts)[:4] for _ in range(24)])
    want = sum(len(set(ids[0, :, layer].reshape(-1).tolist())) for layer in range(24)) / 24
    assert _unique_per_layer(SimpleNamespace(expert_ids=ids), num_experts) == pytest.approx(want, abs=1e-12)
