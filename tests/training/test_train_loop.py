"""Training pieces: schedule, checkpoint round trip, the predictor objective."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from trtllm_moespec.training.checkpoint import Progress, load_checkpoint, save_checkpoint
from trtllm_moespec.training.data import contiguous_windows, random_windows
from trtllm_moespec.training.schedule import cosine_lr
from trtllm_moespec.training.train_predictor import predictor_loss


def test_cosine_lr() -> None:
    assert cosine_lr(0, 0.0, 1.0, 10, 0.1) == pytest.approx(0.1)
    assert cosine_lr(10, 0.0, 1.0, 10, 0.1) == pytest.approx(1.0)
    assert cosine_lr(50, 0.5, 1.0, 10, 0.1) == pytest.approx(0.55)
    assert cosine_lr(99, 1.5, 1.0, 10, 0.1) == pytest.approx(0.1)


def test_checkpoint_roundtrip(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    progress = Progress(step=7, planned_s=60.0, tokens_seen=123, elapsed_s=5.5, best_heldout_loss=2.5)
    save_checkpoint(tmp_path, model, opt, progress)
    model2 = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    assert load_checkpoint(tmp_path, model2, opt2) == progress
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)
    assert torch.equal(opt.state_dict()["state"][0]["exp_avg"], opt2.state_dict()["state"][0]["exp_avg"])
    with pytest.raises(FileNotFoundError, match="cannot resume"):
        load_checkpoint(tmp_path / "nothing", model2, opt2)


def test_windows_are_seeded() -> None:
    import numpy as np

    stream = np.arange(1000, dtype=np.uint16)
    a, b = random_windows(stream, 4, 16, seed=0, step=3), random_windows(stream, 4, 16, seed=0, step=3)
    assert torch.equal(a, b) and a.shape == (4, 17)
    assert torch.equal(a[:, 1:] - a[:, :-1], torch.ones(4, 16, dtype=torch.int64))
    assert not torch.equal(a, random_windows(stream, 4, 16, seed=0, step=4))
    assert contiguous_windows(stream, 99).shape == (10, 100)


def test_predictor_loss_uniform_target() -> None:
    topk = torch.tensor([[[0, 1]]])  # [T=1, L=1, K=2]
    perfect = torch.tensor([[[20.0, 20.0, -20.0, -20.0]]])  # half of the mass on each true expert
    assert predictor_loss(perfect, topk).item() == pytest.approx(math.log(2), abs=1e-6)
    flat = torch.zeros(1, 1, 4)
    assert predictor_loss(flat, topk).item() == pytest.approx(math.log(4))


def test_extended_segment_schedule() -> None:
    from trtllm_moespec.training.train_target import TrainConfig, lr_at

    cfg = TrainConfig(peak_lr=3e-3, warmup_steps=10, min_lr_ratio=0.1)
    first = Progress(step=500, planned_s=100.0, tokens_seen=0, elapsed_s=100.0, best_heldout_loss=3.0)
    assert lr_at(500, 100.0, first, cfg) == pytest.approx(3e-4)  # end of the first cosine
    extended = Progress(500, 160.0, 0, 100.0, 3.0, segment_start_s=100.0, segment_peak_lr=1e-3)
    assert lr_at(500, 100.0, extended, cfg) == pytest.approx(1e-3)
    assert lr_at(600, 130.0, extended, cfg) == pytest.approx(1e-3 * (0.1 + 0.9 * 0.5))


def test_train_layers_freezes_every_other_weight() -> None:
    """`train_layers`: one optimizer step moves only the listed decoder layers' weights (block expansion:
    up-scaled layers trained while the rest of the model holds still), and a layer outside the model is refused."""
    from transformers import Qwen3MoeForCausalLM

    from trtllm_moespec.training.target import TargetShape, make_config
    from trtllm_moespec.training.train_target import TrainConfig, freeze_all_but, make_optimizer, train_step

    torch.manual_seed(0)
    shape = TargetShape(vocab_size=64, hidden_size=32, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1,
                        head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
    model = Qwen3MoeForCausalLM(make_config(shape)).train()
    cfg = TrainConfig(train_layers=(1,), peak_lr=1e-2)
    freeze_all_but(model, cfg.train_layers)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    train_step(model, make_optimizer(model, cfg), torch.randint(0, 64, (2, 17)), cfg.peak_lr, cfg)
    moved = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert moved and all(n.startswith("model.layers.1.") for n in moved)
    assert any("experts" in n for n in moved) and any("self_attn" in n for n in moved)
    with pytest.raises(ValueError, match=r"train_layers \[3\]"):
        freeze_all_but(model, (0, 3))


def test_the_balancing_loss_covers_the_layers_that_train() -> None:
    """With `train_layers`, a step's balancing loss is the mean over those layers' routers alone: a frozen layer's
    router cannot move, so it would only dilute the weight of those that can."""
    from transformers import Qwen3MoeForCausalLM

    from trtllm_moespec.training.target import TargetShape, make_config
    from trtllm_moespec.training.train_target import TrainConfig, freeze_all_but, layer_balance_loss, make_optimizer, train_step

    torch.manual_seed(0)
    shape = TargetShape(vocab_size=64, hidden_size=32, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1,
                        head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
    batch = torch.randint(0, 64, (2, 17))
    for layers in ((), (1,), (0, 2)):
        model = Qwen3MoeForCausalLM(make_config(shape)).train()
        with torch.no_grad():
            model.model.layers[1].mlp.gate.weight.mul_(50.0)  # layer 1 routes far from balance, the others near it
            routers = model(input_ids=batch[:, :-1], output_router_logits=True, use_cache=False).router_logits
        cfg = TrainConfig(train_layers=layers)
        freeze_all_but(model, layers)
        _, aux = train_step(model, make_optimizer(model, cfg), batch, cfg.peak_lr, cfg)
        covered = tuple(routers[l] for l in layers) if layers else routers
        assert aux == pytest.approx(float(layer_balance_loss(covered, 2)), rel=1e-5)
        assert layers == () or aux != pytest.approx(float(layer_balance_loss(routers, 2)), rel=1e-3)


def test_parse_layers() -> None:
    from trtllm_moespec.training.target import parse_layers

    assert parse_layers("2-5,8,10-11") == (2, 3, 4, 5, 8, 10, 11) and parse_layers("") == ()
    with pytest.raises(ValueError, match="'x-3'"):
        parse_layers("1,x-3")


def test_layer_balance_loss_sees_each_layer_apart():
    """One layer equals transformers' pooled loss; two layers each routing to other experts read balanced
    when pooled (the flaw) but not per layer."""
    import torch
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    from trtllm_moespec.training.train_target import layer_balance_loss

    g = torch.Generator().manual_seed(0)
    one = (torch.randn(40, 8, generator=g),)
    assert float(layer_balance_loss(one, 2)) == pytest.approx(float(load_balancing_loss_func(one, 8, 2, None)), rel=1e-5)
    skew = torch.full((64, 8), -20.0)
    skew[:, :4] = torch.randn(64, 4, generator=g)  # layer a uses experts 0-3 only
    flipped = skew.roll(4, dims=1)  # layer b uses experts 4-7 only
    pooled = float(load_balancing_loss_func((skew, flipped), 8, 2, None))
    per_layer = float(layer_balance_loss((skew, flipped), 2))
    assert pooled == pytest.approx(2.0, rel=0.1)  # the two layers together use every expert alike
    assert per_layer > 1.6 * pooled  # each layer half-dead: about twice the balanced value
