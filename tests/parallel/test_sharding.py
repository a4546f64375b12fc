"""Expert sharding and the command encoding, in one process: N ranks simulated by summing each
rank's slot outputs (what the all-reduce does), checked bitwise against the unsharded experts."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.models.conftest import build_hf, gpt_oss_config, qwen3_moe_config
from trtllm_moespec.core import DraftTree, build_layout
from trtllm_moespec.core.placement import ExpertPlacement
from trtllm_moespec.parallel.dist import check_ep_launch
from trtllm_moespec.parallel.experts import ShardedExperts
from trtllm_moespec.parallel.remote import decode_text, encode_text, pack_layout, unpack_layout


def _simulate(experts, placement: ExpertPlacement, hidden, ids, weights) -> torch.Tensor:
    """Run every rank's shard and add their slot buffers as the all-reduce would."""
    T, k = ids.shape
    total = None
    for rank in range(placement.num_ranks):
        sent = []
        shard = ShardedExperts(copy.deepcopy(experts), placement.local_experts(rank), lambda t: sent.append(t.clone()))
        shard(hidden, ids, weights)
        total = sent[0] if total is None else total + sent[0]
    return total.view(T, k, -1).sum(dim=1)


@pytest.mark.parametrize("config", [qwen3_moe_config, gpt_oss_config])
@pytest.mark.parametrize("num_ranks", [2, 4, 8])
def test_sharded_experts_are_bitwise_equal_to_one_process(config, num_ranks):
    model = build_hf(config())
    experts = model.model.layers[0].mlp.experts
    E, k = experts.num_experts, model.config.num_experts_per_tok
    placement = ExpertPlacement.contiguous(1, E, num_ranks)
    g = torch.Generator().manual_seed(num_ranks)
    for T in (1, 5, 33):
        hidden = torch.randn(T, model.config.hidden_size, generator=g)
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
        weights = torch.rand(T, k, generator=g)
        assert torch.equal(_simulate(experts, placement, hidden, ids, weights), experts(hidden, ids, weights))


@pytest.mark.parametrize("config", [qwen3_moe_config, gpt_oss_config])
@pytest.mark.parametrize("grad", [True, False])  # no grad: the compiled CPU experts kernel (experts_host.py)
def test_lean_shards_are_bitwise_equal_to_the_lean_forward(config, grad):
    torch.set_grad_enabled(grad)
    try:
        _check_lean_shards(config)
    finally:
        torch.set_grad_enabled(True)


def _check_lean_shards(config):
    from types import SimpleNamespace

    from trtllm_moespec.models.moe import gpt_oss_weights, qwen3_moe_weights, routed_experts
    from trtllm_moespec.parallel.experts import LeanShard, local_index_of

    model = build_hf(config())
    mlp = model.model.layers[0].mlp
    weights_of = gpt_oss_weights if hasattr(mlp, "router") else qwen3_moe_weights
    _, full = weights_of(mlp)
    E, k = mlp.experts.num_experts, model.config.num_experts_per_tok
    placement = ExpertPlacement.contiguous(1, E, 2)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(9, model.config.hidden_size, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(9)])
    weights = torch.rand(9, k, generator=g)
    total = None
    for rank in range(2):
        local_ids = placement.local_experts(rank)
        shard = ShardedExperts(copy.deepcopy(mlp.experts), local_ids, lambda t: None)
        router = {"router": mlp.router} if hasattr(mlp, "router") else {"gate": mlp.gate}
        _, local = weights_of(SimpleNamespace(experts=shard.inner, **router))
        sent = []
        LeanShard(local, local_index_of(local_ids, E, "cpu"), lambda t: sent.append(t.clone()))(hidden, ids, weights)
        total = sent[0] if total is None else total + sent[0]
    assert torch.equal(total.view(9, k, -1).sum(dim=1), routed_experts(hidden, ids, weights, full))


def test_a_shard_keeps_only_its_experts():
    experts = build_hf(qwen3_moe_config()).model.layers[0].mlp.experts
    full = experts.gate_up_proj.detach().clone()
    shard = ShardedExperts(experts, (4, 5, 6, 7), lambda t: None)
    assert shard.inner.num_experts == 4 and shard.inner.gate_up_proj.shape[0] == 4
    assert torch.equal(shard.inner.gate_up_proj, full[4:])
    # a rank none of whose experts is routed computes nothing and contributes zeros
    hidden, ids, weights = torch.randn(3, 64), torch.tensor([[0, 1], [2, 3], [1, 0]]), torch.rand(3, 2)
    assert torch.equal(shard(hidden, ids, weights), torch.zeros(3, 64))


def test_layout_and_text_round_trip():
    tree = DraftTree.from_parents(torch.tensor([[7, 8, 9, 10]]), torch.tensor([[-1, 0, 0, 1]]),
                                  torch.tensor([[0.6, 0.3, 0.2, 0.1]]))
    layout = build_layout(tree, torch.tensor([[0, 1, 3]]), torch.tensor([5]))
    payload, K, D = pack_layout(layout)
    back = unpack_layout(payload, K, D, torch.device("cpu"))
    for name in ("node_idx", "token_ids", "depth", "parent_pos", "valid", "paths", "num_nodes"):
        assert torch.equal(getattr(back, name), getattr(layout, name)), name
    assert decode_text(encode_text("float32\n/tmp/ü dir")) == "float32\n/tmp/ü dir"


@pytest.mark.parametrize("ep,world,message", [
    (2, 1, "--ep 2 needs 2 ranks"), (2, 4, "started 4 ranks but --ep is 2"), (None, 2, "pass --ep 2"),
    (0, 1, "positive integer"),
])
def test_launch_checks(ep, world, message):
    with pytest.raises(ValueError, match=message):
        check_ep_launch(ep, world)
    assert check_ep_launch(None, 1) == 1 and check_ep_launch(1, 1) == 1 and check_ep_launch(2, 2) == 2
