"""The architecture table: router output forms, capture layers, layer types."""

import pytest
import torch

from trtllm_moespec.models.arch import ARCHITECTURES, arch_spec, default_capture_layers, layer_types, router_topk_ids


def test_router_topk_ids_from_each_router_output_form():
    logits = torch.tensor([[0.1, 2.0, -1.0, 1.5], [3.0, 0.0, 2.5, -2.0]])
    expected = torch.tensor([[1, 3], [0, 2]])
    # transformers 5.x routers: (logits, topk_weights, topk_index)
    assert torch.equal(router_topk_ids((logits, torch.ones(2, 2), expected), top_k=2), expected)
    # GPT-OSS on 4.57: (scores, index)
    assert torch.equal(router_topk_ids((torch.softmax(logits, -1), expected), top_k=2), expected)
    # Qwen3-MoE gate on 4.57: an nn.Linear returning logits; top-k of softmax == top-k of logits
    assert torch.equal(router_topk_ids(logits, top_k=2), expected)
    # [B, T, E] logits are flattened to tokens
    assert router_topk_ids(logits[None], top_k=2).shape == (2, 2)


def test_default_capture_layers_follow_sglang_and_clamp():
    assert default_capture_layers(48) == (2, 24, 45)
    assert default_capture_layers(36) == (2, 18, 33)
    assert default_capture_layers(3) == (2, 1, 0)
    assert all(0 <= i < 2 for i in default_capture_layers(2))
    with pytest.raises(ValueError):
        default_capture_layers(0)


def test_unsupported_architecture_names_the_supported_ones():
    with pytest.raises(ValueError, match="GptOssForCausalLM.*Qwen3MoeForCausalLM"):
        arch_spec("LlamaForCausalLM")
    assert set(ARCHITECTURES) == {"Qwen3MoeForCausalLM", "GptOssForCausalLM"}


def test_layer_types_from_config():
    class C:
        sliding_window = None

    assert layer_types(C(), 2) == ("full_attention",) * 2
    C.sliding_window = 16
    assert layer_types(C(), 2) == ("sliding_attention",) * 2
    C.layer_types = ["sliding_attention", "full_attention"]
    assert layer_types(C(), 2) == ("sliding_attention", "full_attention")
