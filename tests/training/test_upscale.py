"""Warm starts of a target run (training/upscale.py) and the layer/expert ablation (training/ablation.py)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import Qwen3MoeForCausalLM

from trtllm_moespec.training.ablation import ablate, ablate_where_routed, routed_counts
from trtllm_moespec.training.target import TargetShape, make_config
from trtllm_moespec.training.upscale import _copy_expert_half, warm_start

SMALL = TargetShape(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                    head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)


def _model(shape: TargetShape, seed: int) -> Qwen3MoeForCausalLM:
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(make_config(shape)).eval()
    for p in model.parameters():  # transformers 5 leaves some experts' weights at zero init: give every one values
        if p.dim() == 3:
            torch.nn.init.normal_(p, std=0.02)
    return model


@pytest.fixture()
def source_dir(tmp_path: Path) -> Path:
    _model(SMALL, 0).save_pretrained(tmp_path / "src")
    return tmp_path / "src"


def test_same_shape_warm_start_copies_the_model(source_dir: Path) -> None:
    model = _model(SMALL, 1)
    assert warm_start(model, source_dir) == "copy"
    ids = torch.randint(0, 64, (1, 12))
    expected = Qwen3MoeForCausalLM.from_pretrained(source_dir, dtype=torch.float32)(ids).logits
    assert torch.equal(model(ids).logits, expected)


def test_expert_halves_sum_to_the_source_expert() -> None:
    """A SwiGLU expert is a sum over its neurons: the two halves' outputs add up to the whole's."""
    source = _model(SMALL, 0).model.layers[0].mlp.experts
    halves = [_model(replace(SMALL, moe_intermediate_size=8), 2).model.layers[0].mlp.experts for _ in range(2)]
    with torch.no_grad():
        for h, half in enumerate(halves):
            _copy_expert_half(half, source, h)
    hidden = torch.randn(5, 32)
    index = torch.tensor([[0, 3], [1, 2], [2, 0], [3, 1], [0, 1]])
    weights = torch.rand(5, 2)
    whole = source(hidden, index, weights)
    assert torch.allclose(halves[0](hidden, index, weights) + halves[1](hidden, index, weights), whole, atol=1e-6)


def test_upscale_keeps_the_source_function_closely(source_dir: Path) -> None:
    """Pairs hold the source layers (split experts), the other layers start as identities."""
    deep = replace(SMALL, num_hidden_layers=8, moe_intermediate_size=8)
    model = _model(deep, 3)
    assert warm_start(model, source_dir) == "upscale"
    for j in range(2):
        for c in range(2, 4):
            layer = model.model.layers[4 * j + c]
            assert not layer.self_attn.o_proj.weight.any() and not layer.mlp.experts.down_proj.any()
            assert layer.self_attn.q_proj.weight.any()  # fresh, trainable weights, not copies of nothing
    ids = torch.randint(0, 64, (2, 16))
    source = Qwen3MoeForCausalLM.from_pretrained(source_dir, dtype=torch.float32)
    p_src, p_up = source(ids).logits.softmax(-1), model(ids).logits.softmax(-1)
    p_random = _model(deep, 4)(ids).logits.softmax(-1)
    tv_up, tv_random = (p_src - p_up).abs().sum(-1).mean() / 2, (p_src - p_random).abs().sum(-1).mean() / 2
    assert tv_up < 0.25 * tv_random, (tv_up, tv_random)


def test_warm_start_refuses_other_shapes(source_dir: Path) -> None:
    with pytest.raises(ValueError, match="hidden_size 32 != 64"):
        warm_start(_model(replace(SMALL, hidden_size=64, head_dim=32), 0), source_dir)
    with pytest.raises(ValueError, match="up-scaling needs"):
        warm_start(_model(replace(SMALL, num_hidden_layers=3, moe_intermediate_size=8), 0), source_dir)


def test_ablation_finds_a_dead_layer_and_a_dead_expert() -> None:
    model = _model(SMALL, 0)
    with torch.no_grad():
        model.model.layers[1].self_attn.o_proj.weight.zero_()
        model.model.layers[1].mlp.experts.down_proj.zero_()  # layer 1 does nothing at all
        model.model.layers[0].mlp.experts.down_proj[2].zero_()  # one dead expert in layer 0
    report = ablate(model, torch.randint(0, 64, (2, 17)), progress=False)
    assert report.layer_delta[1] == 0.0 and report.layer_delta[0] != 0.0
    assert report.expert_delta[0][2] == 0.0 and report.expert_delta[1] == [0.0] * 4
    assert sum(d != 0 for d in report.expert_delta[0]) == 3
    assert abs(sum(report.expert_share[0]) - 1.0) < 1e-9
    assert report.summary()["experts_changing_loss"] == 3


def test_an_expert_no_fixed_window_reaches_is_judged_on_a_window_that_routes_to_it() -> None:
    """Each expert is judged on the window that routes most pairs to it: there every routed expert changes the
    loss, and a dead one (output zeroed) does not."""
    model = _model(SMALL, 0)
    windows = torch.randint(0, 64, (3, 17))
    with torch.no_grad():
        model.model.layers[0].mlp.experts.down_proj[1].zero_()  # a dead expert
    counts = routed_counts(model, windows, batch_size=2)  # [W, L, E]
    assert counts.shape == (3, 2, 4) and (counts.sum(-1) == 16 * 2).all()  # every token routes top-2 per layer
    rows = {(r.layer, r.expert): r for r in ablate_where_routed(model, windows, progress=False)}
    dead = rows[(0, 1)]
    assert len(rows) == 8 and dead.loss_delta == 0.0 and dead.top1_changed == 0 and dead.logit_change == 0.0
    for (l, e), r in rows.items():
        assert r.window == int(counts[:, l, e].argmax()) and r.window_pairs == int(counts[r.window, l, e])
        assert r.total_pairs == int(counts[:, l, e].sum())
        if (l, e) != (0, 1) and r.window_pairs:
            assert r.loss_delta != 0.0 and r.logit_change > 0
