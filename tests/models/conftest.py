"""Tiny random Qwen3-MoE and GPT-OSS targets built from transformers configs (CPU, float32)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")


def qwen3_moe_config(**overrides):
    kw = dict(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
              max_position_embeddings=512, initializer_range=0.1, tie_word_embeddings=False)
    kw.update(overrides)
    return transformers.Qwen3MoeConfig(**kw)


def gpt_oss_config(**overrides):
    kw = dict(vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2, sliding_window=8,
              max_position_embeddings=4096, initializer_range=0.1,
              layer_types=["sliding_attention", "full_attention"] * 2)
    kw.update(overrides)
    return transformers.GptOssConfig(**kw)


def build_hf(config, seed: int = 0):
    torch.manual_seed(seed)
    if config.model_type == "gpt_oss":
        config._attn_implementation = "eager"  # attention sinks; TargetModel.load forces the same
        return transformers.GptOssForCausalLM(config).eval()
    return transformers.Qwen3MoeForCausalLM(config).eval()


@pytest.fixture(scope="module", params=["qwen3_moe", "gpt_oss"])
def hf_model(request):
    config = qwen3_moe_config() if request.param == "qwen3_moe" else gpt_oss_config()
    return build_hf(config)


@pytest.fixture(scope="module")
def saved_qwen(tmp_path_factory):
    """A tiny Qwen3-MoE checkpoint directory (safetensors) and its config."""
    path = tmp_path_factory.mktemp("qwen3_moe")
    model = build_hf(qwen3_moe_config())
    model.save_pretrained(str(path))
    return path, model


@pytest.fixture(scope="module")
def drafter(tmp_path_factory):
    """A random EAGLE-3 drafter (96-token draft vocabulary) for a tiny Qwen3-MoE target (one per module:
    tests may change its state)."""
    from trtllm_moespec.models.eagle3 import load_eagle3, write_random_drafter
    from trtllm_moespec.models.target import TargetModel

    target = TargetModel(build_hf(qwen3_moe_config(), seed=11))
    path = write_random_drafter(target.config, tmp_path_factory.mktemp("eagle3"), seed=3, draft_vocab_size=96,
                                with_embeddings=False, init_std=0.2)
    return load_eagle3(path, target=target)


def count_calls(monkeypatch, obj, name: str) -> list[int]:
    """Count calls of obj.<name> from now on (the count is element 0 of the returned list)."""
    calls, method = [0], getattr(obj, name)

    def counted(*args, **kwargs):
        calls[0] += 1
        return method(*args, **kwargs)

    monkeypatch.setattr(obj, name, counted)
    return calls
