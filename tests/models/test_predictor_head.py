"""Our draft-head expert predictor: shapes, save/load, target checks, training signal, and the
engine adapter (HeadExperts) on a real drafted tree, including load_predictor's dispatch."""

from __future__ import annotations

import json

import pytest
import torch

from trtllm_moespec.core.experts import ExpertSets, num_words, popcount
from trtllm_moespec.engine.predictors import HeadExperts, LearnedExperts
from trtllm_moespec.models.eagle3 import load_eagle3, write_random_drafter
from trtllm_moespec.models.predictor_head import (DraftHeadPredictor, HeadPredictorConfig, HeadPredictorModel,
                                                  head_loss, is_head_predictor_dir)
from trtllm_moespec.models.target import TargetModel
from trtllm_moespec.resolve import ModelPaths, load_predictor

from .conftest import build_hf, qwen3_moe_config


@pytest.fixture(scope="module")
def target():
    return TargetModel(build_hf(qwen3_moe_config(), seed=5))


def _config(target: TargetModel, **kw) -> HeadPredictorConfig:
    return HeadPredictorConfig(hidden_size=target.hidden_size, embed_size=target.hidden_size,
                               vocab_size=target.vocab_size, target_num_layers=len(target.moe_layers),
                               target_num_experts=target.num_experts, target_topk=target.experts_per_token,
                               intermediate_size=32, max_depth=4, **kw)


def test_shapes_and_topk(target) -> None:
    head = DraftHeadPredictor(HeadPredictorModel(_config(target)))
    N, H = 7, target.hidden_size
    ids = torch.randint(0, target.vocab_size, (N,))
    with pytest.raises(ValueError, match="bind_embedding"):
        head.predict(torch.randn(N, H), ids, torch.arange(1, N + 1), torch.randn(H), 3)
    head.bind_embedding(target.input_embeddings())
    node_topk, root_topk = head.predict(torch.randn(N, H), ids, torch.arange(1, N + 1), torch.randn(H), 3)
    L, K = len(target.moe_layers), target.experts_per_token
    assert node_topk.shape == (N, L, K) and root_topk.shape == (L, K)
    assert node_topk.dtype == torch.int64 and int(node_topk.max()) < target.num_experts
    assert bool((node_topk[..., 1:] > node_topk[..., :-1]).all())  # sorted, distinct
    with pytest.raises(ValueError, match="node_hidden must be"):
        head.predict(torch.randn(N, H + 1), ids, torch.ones(N, dtype=torch.int64), torch.randn(H), 3)
    with pytest.raises(ValueError, match="does not match the head"):
        head.bind_embedding(torch.nn.Embedding(target.vocab_size + 1, H))


def test_lookup_tables_equal_the_training_forward(target) -> None:
    """Inference splits the input layers into a per-token table and the hidden half: same logits."""
    torch.manual_seed(2)
    model = HeadPredictorModel(_config(target))
    torch.nn.init.normal_(model.depth_bias.weight)
    embed = target.input_embeddings()
    ids, depth = torch.randint(0, target.vocab_size, (9,)), torch.tensor([0, 1, 2, 3, 4, 5, 9, 1, 0])
    hidden = torch.randn(9, target.hidden_size)
    with torch.no_grad():
        ref = model(hidden, embed(ids), depth)
        got = model.forward_tables(hidden, ids, depth, model.token_tables(embed.weight))
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    # inference's layout, the root last: the rows split by position give the same logits
    depth = torch.tensor([1, 2, 3, 4, 5, 9, 1, 2, 0])
    with torch.no_grad():
        ref = model(hidden, embed(ids), depth)
        got = model.forward_tables(hidden, ids, depth, model.token_tables(embed.weight), root_last=True)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_root_and_nodes_use_their_own_input_layer(target) -> None:
    model = HeadPredictorModel(_config(target))
    h, e = torch.randn(3, target.hidden_size), torch.randn(3, target.hidden_size)
    as_root = model(h, e, torch.zeros(3, dtype=torch.int64))
    as_node = model(h, e, torch.ones(3, dtype=torch.int64))
    assert not torch.allclose(as_root, as_node)


def test_save_load_round_trip_and_checks(target, tmp_path) -> None:
    torch.manual_seed(0)
    head = DraftHeadPredictor(HeadPredictorModel(_config(target)))
    head.save(tmp_path / "head", dtype=torch.float32)
    cfg = json.loads((tmp_path / "head" / "config.json").read_text())
    assert cfg["predictor_type"] == "draft_head" and cfg["target_num_experts"] == target.num_experts
    assert is_head_predictor_dir(tmp_path / "head") and not is_head_predictor_dir(tmp_path)
    loaded = DraftHeadPredictor.load(tmp_path / "head")
    for (k, a), (_, b) in zip(head.model.state_dict().items(), loaded.model.state_dict().items()):
        assert torch.equal(a, b), k
    loaded.check_target(len(target.moe_layers), target.num_experts, target.experts_per_token, target.vocab_size,
                        target.hidden_size)
    with pytest.raises(ValueError, match="num_experts"):
        loaded.check_target(len(target.moe_layers), target.num_experts * 2, target.experts_per_token,
                            target.vocab_size, target.hidden_size)
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text(json.dumps({**cfg, "predictor_type": "standalone"}))
    (tmp_path / "bad" / "model.safetensors").write_bytes((tmp_path / "head" / "model.safetensors").read_bytes())
    with pytest.raises(ValueError, match="predictor_type"):
        DraftHeadPredictor.load(tmp_path / "bad")
    (tmp_path / "bad" / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 48}))
    with pytest.raises(ValueError, match="does not match its config.json"):
        DraftHeadPredictor.load(tmp_path / "bad")
    with pytest.raises(FileNotFoundError):
        DraftHeadPredictor.load(tmp_path / "missing")


def test_layerwise_ce_training_learns_a_routing_rule(target) -> None:
    """The head fits experts that depend on the token (the real objective, a few hundred steps)."""
    torch.manual_seed(0)
    cfg = _config(target)
    model = HeadPredictorModel(cfg)
    embed = target.input_embeddings()
    tokens = torch.randint(0, target.vocab_size, (512,))
    rule = torch.stack([torch.randperm(cfg.target_num_experts)[: cfg.target_topk]
                        for _ in range(target.vocab_size * cfg.target_num_layers)])
    topk = rule.view(target.vocab_size, cfg.target_num_layers, cfg.target_topk)[tokens].sort(-1).values
    hidden, depth = torch.randn(512, cfg.hidden_size), torch.randint(0, 5, (512,))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with torch.no_grad():
        embeds = embed(tokens)
    first = head_loss(model(hidden, embeds, depth), topk).item()
    for _ in range(150):
        loss = head_loss(model(hidden, embeds, depth), topk)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.6 * first


def test_head_experts_on_a_drafted_tree_and_dispatch(target, tmp_path) -> None:
    path = write_random_drafter(target.config, tmp_path / "eagle3", seed=3, with_embeddings=False, init_std=0.2)
    drafter = load_eagle3(path, target=target)
    prompt = torch.randint(0, target.vocab_size, (1, 9), generator=torch.Generator().manual_seed(1))
    pre = target.prefill(target.new_cache(), prompt)
    cache = drafter.new_cache()
    drafter.prefill(cache, prompt, pre.hidden, next_token=4)
    draft = drafter.draft_tree(cache, steps=3, topk=4)
    torch.manual_seed(0)
    DraftHeadPredictor(HeadPredictorModel(_config(target))).save(tmp_path / "head")
    adapter = load_predictor(None, ModelPaths(tmp_path, path, tmp_path / "head", "t", tmp_path / "p.json"), target,
                             drafter)
    assert isinstance(adapter, HeadExperts)
    context = prompt[0].tolist() + [4]
    experts, root_bits = adapter.predict(context, draft.tree, draft, None)
    N, L = draft.tree.num_nodes, len(target.moe_layers)
    assert isinstance(experts, ExpertSets) and experts.bits.shape == (1, N, num_words(L, target.num_experts))
    assert root_bits.shape == (1, num_words(L, target.num_experts)) and root_bits.dtype == torch.int64
    assert popcount(experts.bits).eq(L * target.experts_per_token).all()  # K experts per layer
    # the root's feature is the hidden that proposed the depth-1 nodes, with the root token's embedding
    head = adapter.head
    with torch.no_grad():
        logits = head.model(cache.last_hidden, target.input_embeddings()(torch.tensor([4])), torch.zeros(1, dtype=torch.int64))
    root_topk = logits[0].topk(target.experts_per_token, dim=-1).indices
    assert torch.equal(root_bits, ExpertSets.from_topk_ids(root_topk[None, None], target.num_experts).bits[:, 0])
    with pytest.raises(ValueError, match="node_hidden"):
        adapter.predict(context, draft.tree, type("NoHidden", (), {"node_hidden": None})(), None)
    # a standalone predictor directory still loads the standalone adapter
    from trtllm_moespec.models.predictor import ExpertPredictor, PredictorConfig, PredictorModel

    ExpertPredictor(PredictorModel(PredictorConfig(
        vocab_size=target.vocab_size, hidden_size=16, num_heads=2, head_dim=8, intermediate_size=32,
        target_num_layers=L, target_num_experts=target.num_experts, target_topk=target.experts_per_token))
    ).save(tmp_path / "standalone")
    standalone = load_predictor(None, ModelPaths(tmp_path, path, tmp_path / "standalone", "t", tmp_path / "p.json"),
                                target)
    assert isinstance(standalone, LearnedExperts)
    wrong = TargetModel(build_hf(qwen3_moe_config(num_experts=16), seed=5))
    with pytest.raises(ValueError, match="draft-head expert predictor was trained for"):
        load_predictor(None, ModelPaths(tmp_path, path, tmp_path / "head", "t", tmp_path / "p.json"), wrong, drafter)
