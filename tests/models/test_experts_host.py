"""The compiled CPU experts kernel (models/experts_host.py) against the torch paths it replaces: the same
layer output to float rounding for both architectures (biases, clamped SwiGLU, both weight layouts), a
token's output independent of the tokens beside it, bad ids refused, and the kernel really running
where it should and not where it must not."""

import numpy as np
import pytest
import torch

from trtllm_moespec.models import experts_host, moe
from trtllm_moespec.models.moe import gpt_oss_weights, qwen3_moe_weights, route, routed_experts

from .conftest import build_hf, gpt_oss_config, qwen3_moe_config

pytestmark = pytest.mark.skipif(experts_host.compiled_experts() is None, reason="numba is not installed")


def _layer(arch: str, **overrides):
    config = qwen3_moe_config(**overrides) if arch == "qwen3_moe" else gpt_oss_config(**overrides)
    mlp = build_hf(config).model.layers[0].mlp
    if arch == "gpt_oss":  # transformers starts these biases at zero; the kernel must add them
        with torch.no_grad():
            for bias in (mlp.experts.gate_up_proj_bias, mlp.experts.down_proj_bias):
                bias.normal_(0, 0.5, generator=torch.Generator().manual_seed(7))
    router, experts = gpt_oss_weights(mlp) if arch == "gpt_oss" else qwen3_moe_weights(mlp)
    return config, router, experts


def _counting(monkeypatch) -> list[int]:
    calls = []
    kernel = moe.routed_slots
    monkeypatch.setattr(moe, "routed_slots", lambda x, *a: calls.append(x.shape[0]) or kernel(x, *a))
    return calls


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
@pytest.mark.parametrize("num_tokens", [1, 2, 5, 33])
@torch.no_grad()
def test_the_kernel_equals_the_torch_paths(arch, num_tokens, monkeypatch):
    config, router, experts = _layer(arch)
    assert experts.host is not None
    x = torch.randn(num_tokens, config.hidden_size, generator=torch.Generator().manual_seed(num_tokens)) * 4
    ids, weights = route(x, router)
    calls = _counting(monkeypatch)
    out = routed_experts(x, ids, weights, experts)
    assert calls == [num_tokens]  # the kernel ran, not a torch fallback
    grouped = routed_experts(x, ids, weights, experts, looped=False)
    torch.testing.assert_close(out, grouped, atol=1e-5, rtol=1e-5)
    assert grouped.abs().max() > 0.1  # a real layer output, not zeros on both sides


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
@torch.no_grad()
def test_a_tokens_output_does_not_depend_on_the_batch(arch):
    """The same loops run for every pair, so a plain step and a verify agree bit for bit on a token."""
    config, router, experts = _layer(arch)
    x = torch.randn(9, config.hidden_size, generator=torch.Generator().manual_seed(1))
    ids, weights = route(x, router)
    batch = routed_experts(x, ids, weights, experts)
    for n in (0, 4, 8):
        assert torch.equal(routed_experts(x[n:n + 1], ids[n:n + 1], weights[n:n + 1], experts), batch[n:n + 1])


@pytest.mark.parametrize("bad", [-1, 8])
@torch.no_grad()
def test_an_expert_id_out_of_range_is_refused(bad, monkeypatch):
    """8 experts: ids -1 and 8 are outside the layer. The kernel says so instead of reading past its
    weights, and routed_experts then leaves it to the torch path (which raises on its own)."""
    config, router, experts = _layer("qwen3_moe")
    x = torch.randn(3, config.hidden_size)
    ids, weights = route(x, router)
    ids[1, 0] = bad
    assert experts_host.routed_slots(x, ids, weights, experts.host) is None
    ids[1, 0] = 7
    assert experts_host.routed_slots(x, ids, weights, experts.host) is not None


@torch.no_grad()
def test_a_weight_shape_that_does_not_fit_is_refused():
    config, router, experts = _layer("qwen3_moe")
    host = experts.host
    x = torch.randn(2, config.hidden_size)
    ids, weights = route(x, router)
    out = np.empty((2 * ids.shape[1], config.hidden_size), np.float32)
    kernel = experts_host.compiled_experts()[0]
    args = (x.numpy(), ids.numpy(), weights.numpy(), host.gate_up, host.gate_up_bias, host.down[:, :, :-1],
            host.down_bias, True, experts_host.SILU_GATED, np.float32(0), np.float32(0), out)
    assert kernel(*args) is False


def test_where_the_kernel_does_not_run(monkeypatch):
    """With gradients (training, EP shards under autograd), weights that are not float32, the switch off,
    or more pairs than HOST_MAX_PAIRS: the torch paths."""
    config, router, experts = _layer("qwen3_moe")
    x = torch.randn(3, config.hidden_size)
    ids, weights = route(x, router)
    calls = _counting(monkeypatch)
    assert routed_experts(x, ids, weights, experts).requires_grad  # grad enabled: autograd's path
    with torch.no_grad():
        monkeypatch.setenv("MOESPEC_HOST_EXPERTS", "0")
        assert experts_host.routed_slots(x, ids, weights, experts.host) is None
        monkeypatch.delenv("MOESPEC_HOST_EXPERTS")
        routed_experts(x, ids, weights, experts, looped=True)
        many = experts_host.HOST_MAX_PAIRS // ids.shape[1] + 1
        big = torch.randn(many, config.hidden_size)
        routed_experts(big, *route(big, router), experts)
    assert calls == []
    half = qwen3_moe_weights(build_hf(qwen3_moe_config()).to(torch.bfloat16).model.layers[0].mlp)[1]
    assert half.host is None


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_the_lean_forward_runs_the_kernel(arch, monkeypatch):
    """A plain step and a tree verify of the target both go through the kernel (their outputs against
    transformers' are pinned by test_lean_forward.py)."""
    from trtllm_moespec.models.target import TargetModel

    config = qwen3_moe_config() if arch == "qwen3_moe" else gpt_oss_config()
    target = TargetModel(build_hf(config), model_impl="lean")
    calls = _counting(monkeypatch)
    cache = target.new_cache()
    target.prefill(cache, torch.randint(0, 128, (1, 7)))
    target.prefill(cache, torch.randint(0, 128, (1, 1)))
    moe_layers = sum(layer.router is not None for layer in target.lean.layers)
    assert calls == [7] * moe_layers + [1] * moe_layers
