"""Expert predictor: shapes, tree attention == path attention, save/load and its errors."""

from __future__ import annotations

import json

import pytest
import torch

from trtllm_moespec.core.tree import DraftTree
from trtllm_moespec.models.predictor import (
    ExpertPredictor,
    PredictorConfig,
    PredictorModel,
    ancestor_mask,
    causal_mask,
    topk_overlap,
    tree_inputs,
)

CFG = PredictorConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=2, head_dim=16, intermediate_size=48,
                      max_seq_len=32, context_window=8, target_num_layers=3, target_num_experts=8, target_topk=2)


@pytest.fixture(scope="module")
def predictor() -> ExpertPredictor:
    torch.manual_seed(0)
    model = PredictorModel(CFG)
    with torch.no_grad():  # larger weights than the init so that routing differs per context
        for p in model.parameters():
            p.normal_(0, 0.3) if p.dim() > 1 else None
    return ExpertPredictor(model)


def _tree() -> DraftTree:
    # root -> 0 -> 2 -> 4 ; root -> 1 -> 3 ; 0 -> 5
    parents = torch.tensor([[-1, -1, 0, 1, 2, 0]])
    token_ids = torch.tensor([[5, 9, 11, 13, 17, 19]])
    return DraftTree.from_parents(token_ids, parents, torch.full((1, 6), 0.5))


def _path(tree: DraftTree, node: int) -> list[int]:
    path = []
    while node >= 0:
        path.append(node)
        node = int(tree.parents[0, node])
    return path[::-1]


def test_ancestor_mask_hand_built() -> None:
    anc = ancestor_mask(torch.tensor([-1, -1, 0, 1, 2, 0]))
    assert anc[4].nonzero().flatten().tolist() == [0, 2, 4]
    assert anc[3].nonzero().flatten().tolist() == [1, 3]
    assert anc[5].nonzero().flatten().tolist() == [0, 5]


def test_tree_logits_equal_path_logits(predictor: ExpertPredictor) -> None:
    tree = _tree()
    context = torch.tensor([3, 1, 4, 1, 5, 9, 2])
    ids, pos, mask = tree_inputs(context, tree.parents[0], tree.depth[0], tree.token_ids[0])
    tree_logits = predictor.routing_logits(ids, pos, mask)[0]  # [C+N, L, E]
    C = context.shape[0]
    for node in range(tree.num_nodes):
        seq = torch.cat([context, tree.token_ids[0, _path(tree, node)]])
        seq_logits = predictor.routing_logits(seq[None], torch.arange(len(seq))[None], causal_mask(len(seq)))[0]
        torch.testing.assert_close(tree_logits[C + node], seq_logits[-1], atol=1e-5, rtol=1e-5)
    # the context rows are unaffected by the tree
    ctx_logits = predictor.routing_logits(context[None], torch.arange(C)[None], causal_mask(C))[0]
    torch.testing.assert_close(tree_logits[:C], ctx_logits, atol=1e-5, rtol=1e-5)


def test_predict_tree_shapes_and_consistency(predictor: ExpertPredictor) -> None:
    tree = _tree()
    context = torch.arange(20) % CFG.vocab_size  # longer than context_window: truncated to the last 8
    node_topk, root_topk = predictor.predict_tree(context, tree)
    assert node_topk.shape == (6, CFG.target_num_layers, CFG.target_topk) and node_topk.dtype == torch.int64
    assert root_topk.shape == (CFG.target_num_layers, CFG.target_topk)
    assert int(node_topk.max()) < CFG.target_num_experts and int(node_topk.min()) >= 0
    window = context[-CFG.context_window :]
    seq = predictor.predict_sequence(torch.cat([window, tree.token_ids[0, _path(tree, 4)]]))
    assert torch.equal(root_topk, seq[CFG.context_window - 1])
    assert torch.equal(node_topk[4], seq[-1])
    with pytest.raises(ValueError, match="batch_index"):
        predictor.predict_tree(context, tree, batch_index=1)


def test_topk_overlap() -> None:
    pred = torch.tensor([[[0, 1], [2, 3]]])
    true = torch.tensor([[[1, 0], [3, 4]]])
    assert topk_overlap(pred, true) == pytest.approx(0.75)


def test_save_load_roundtrip_and_errors(predictor: ExpertPredictor, tmp_path) -> None:
    predictor.save(tmp_path / "p", dtype=torch.float32)
    loaded = ExpertPredictor.load(tmp_path / "p")
    ids = torch.tensor([1, 2, 3, 4])
    assert torch.equal(loaded.predict_sequence(ids), predictor.predict_sequence(ids))
    loaded.check_target(3, 8, 2, 64)
    with pytest.raises(ValueError, match="trained for a target"):
        loaded.check_target(4, 32, 4, 4096)
    with pytest.raises(FileNotFoundError, match="config.json"):
        ExpertPredictor.load(tmp_path / "missing")
    (tmp_path / "p" / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="cannot read"):
        ExpertPredictor.load(tmp_path / "p")
    predictor.save(tmp_path / "q")
    raw = json.loads((tmp_path / "q" / "config.json").read_text())
    (tmp_path / "q" / "config.json").write_text(json.dumps({**raw, "hidden_size": 48}))
    with pytest.raises(ValueError, match="does not match"):
        ExpertPredictor.load(tmp_path / "q")
    (tmp_path / "q" / "config.json").write_text(json.dumps({**raw, "model_type": "qwen3_moe"}))
    with pytest.raises(ValueError, match="model_type"):
        ExpertPredictor.load(tmp_path / "q")
