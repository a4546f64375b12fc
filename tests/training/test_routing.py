"""Router traces through forward hooks, utilisation statistics and the C(k) probe."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import Qwen3MoeForCausalLM

from trtllm_moespec.training.cost_probe import measure_cost_curve
from trtllm_moespec.training.routing import capture_topk, utilisation
from trtllm_moespec.training.target import TargetShape, make_config

SMALL = TargetShape(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                    head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, max_position_embeddings=128)


@pytest.fixture(scope="module")
def model() -> Qwen3MoeForCausalLM:
    torch.manual_seed(0)
    m = Qwen3MoeForCausalLM(make_config(SMALL)).eval()
    with torch.no_grad():
        for layer in m.model.layers:
            layer.mlp.gate.weight.normal_(0, 1.0)  # the default init routes every token alike
    return m


def test_capture_matches_router_logits(model: Qwen3MoeForCausalLM) -> None:
    ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(1))
    topk = capture_topk(model, ids)
    assert topk.shape == (2, 10, 2, 2)
    with torch.no_grad():
        router_logits = model(input_ids=ids, output_router_logits=True).router_logits  # L x [B*T, E]
    for layer, logits in enumerate(router_logits):
        want = logits.softmax(-1).topk(2, dim=-1).indices.sort(-1).values.view(2, 10, 2)
        assert torch.equal(topk[:, :, layer], want)


def test_utilisation_hand_built() -> None:
    topk = torch.tensor([[[0, 1]], [[0, 2]], [[0, 3]], [[0, 1]]])  # 4 tokens, 1 layer, K = 2, E = 4
    util = utilisation(topk, num_experts=4)
    assert util.fractions[0].tolist() == [0.5, 0.25, 0.125, 0.125]
    assert util.entropy_bits[0].item() == pytest.approx(1.75)
    assert util.frac_below_1pct[0].item() == 0.0
    assert utilisation(topk, num_experts=8).frac_below_1pct[0].item() == 0.5


def test_cost_curve_shapes(model: Qwen3MoeForCausalLM) -> None:
    stream = np.arange(300, dtype=np.uint16) % 64
    points = measure_cost_curve(model, stream, ks=(1, 8), prefix_len=16, num_offsets=1, reps=1)
    assert [p.k for p in points] == [1, 8]
    assert points[0].unique_experts == 2
    assert 2 <= points[1].unique_experts <= 8
    # Totals and MoE times are separate timed passes (a noisy machine can order them either way).
    assert all(p.seconds > 0 and p.moe_seconds > 0 for p in points)
