"""TargetModel: tree verification equals branch-wise causal decoding, KV compaction equals
one-by-one decoding, captures equal transformers' own outputs, and bad checkpoints fail early."""

import json
import shutil

import pytest
import torch

from trtllm_moespec.core.layout import build_layout
from trtllm_moespec.core.tree import DraftTree
from trtllm_moespec.models.target import TargetModel

from .conftest import build_hf, gpt_oss_config, qwen3_moe_config

ATOL = 2e-4


@pytest.fixture(params=["lean", "hf"])
def model_impl(request):
    return request.param


def random_tree(num_nodes: int, vocab: int, gen: torch.Generator) -> DraftTree:
    """A random tree (any shape, parents before children) with random tokens."""
    parents = torch.tensor([[int(torch.randint(-1, i, (1,), generator=gen)) if i else -1 for i in range(num_nodes)]])
    tokens = torch.randint(0, vocab, (1, num_nodes), generator=gen)
    return DraftTree.from_parents(tokens, parents, torch.full((1, num_nodes), 0.5))


def plain_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """[T, V] logits of a plain causal forward without any cache."""
    with torch.no_grad():
        return model(ids).logits[0].float()


def test_tree_verify_equals_each_branch_decoded_causally(hf_model, model_impl):
    target = TargetModel(hf_model, model_impl=model_impl)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 128, (1, 11), generator=gen)  # with GPT-OSS's window 8, tree keys cross it
    cache = target.new_cache()
    target.prefill(cache, prompt)
    tree = random_tree(9, 128, gen)
    layout = build_layout(tree, torch.arange(9)[None], torch.tensor([7]))
    out = target.verify(cache, layout)
    assert out.logits.shape == (1, 10, 128)
    for pos in range(10):
        path = [p for p in layout.paths[0, pos].tolist() if p >= 0]
        branch = torch.cat([prompt, layout.token_ids[:, path]], 1)
        torch.testing.assert_close(out.logits[0, pos], plain_logits(hf_model, branch)[-1], atol=ATOL, rtol=0)


def test_commit_equals_decoding_accepted_tokens_one_by_one(hf_model, model_impl):
    target = TargetModel(hf_model, model_impl=model_impl)
    gen = torch.Generator().manual_seed(0)
    committed = torch.randint(0, 128, (1, 6), generator=gen)
    cache = target.new_cache()
    target.prefill(cache, committed[:, :-1])
    root = committed[:, -1]
    for _ in range(4):  # several steps: GPT-OSS's window (8) is crossed by the committed sequence
        tree = random_tree(8, 128, gen)
        layout = build_layout(tree, torch.arange(8)[None], root)
        target.verify(cache, layout)
        leaf = int(torch.randint(0, 9, (1,), generator=gen))
        accepted = [p for p in layout.paths[0, leaf].tolist()[1:] if p >= 0]
        target.commit(cache, torch.tensor(accepted + [-1]))
        committed = torch.cat([committed, layout.token_ids[:, accepted]], 1)
        assert cache.num_tokens == committed.shape[1]
        if model_impl == "hf":
            assert all(layer.keys.shape[2] == cache.num_tokens for layer in cache.kv.layers)
        bonus = torch.randint(0, 128, (1, 1), generator=gen)
        out = target.prefill(cache, bonus)  # one plain decoding step on the compacted cache
        committed = torch.cat([committed, bonus], 1)
        torch.testing.assert_close(out.logits[0, -1], plain_logits(hf_model, committed)[-1], atol=ATOL, rtol=0)
        root = torch.randint(0, 128, (1,), generator=gen)  # next step's root (not yet in the cache)
        committed = torch.cat([committed, root[None]], 1)


def test_root_only_verify_is_plain_decoding(hf_model, model_impl):
    target = TargetModel(hf_model, model_impl=model_impl)
    ids = torch.randint(0, 128, (1, 10), generator=torch.Generator().manual_seed(3))
    cache = target.new_cache()
    target.prefill(cache, ids[:, :-1])
    layout = build_layout(DraftTree.empty(1), torch.zeros(1, 0, dtype=torch.int64), ids[:, -1])
    out = target.verify(cache, layout)
    target.commit(cache, torch.zeros(0, dtype=torch.int64))
    assert cache.num_tokens == 10
    torch.testing.assert_close(out.logits[0, 0], plain_logits(hf_model, ids)[-1], atol=ATOL, rtol=0)


def test_captures_equal_transformers_hidden_states_and_routing(hf_model, model_impl):
    target = TargetModel(hf_model, capture_layers=(0, 1, 2), model_impl=model_impl)
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(4))
    cache = target.new_cache()
    out = target.prefill(cache, ids, all_logits=True)
    with torch.no_grad():
        ref = hf_model(ids, output_hidden_states=True, output_router_logits=True)
    H = target.hidden_size
    for j, layer in enumerate(target.capture_layers):  # hidden_states[i] is the input of layer i
        torch.testing.assert_close(out.hidden[0, :, j * H:(j + 1) * H], ref.hidden_states[layer][0], atol=ATOL, rtol=0)
    ref_ids = torch.stack([r.topk(target.experts_per_token, -1).indices for r in ref.router_logits], 1)
    assert out.expert_ids.shape == (1, 12, len(target.moe_layers), target.experts_per_token)
    assert torch.equal(out.expert_ids[0].sort(-1).values, ref_ids.sort(-1).values)
    torch.testing.assert_close(out.logits[0], ref.logits[0], atol=ATOL, rtol=0)


def test_verify_router_ids_equal_branch_routing(model_impl):
    model = build_hf(qwen3_moe_config(), seed=5)
    target = TargetModel(model, model_impl=model_impl)
    gen = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, 128, (1, 7), generator=gen)
    cache = target.new_cache()
    target.prefill(cache, prompt)
    layout = build_layout(random_tree(6, 128, gen), torch.arange(6)[None], torch.tensor([3]))
    out = target.verify(cache, layout)
    for pos in range(7):
        path = [p for p in layout.paths[0, pos].tolist() if p >= 0]
        branch = target.prefill(target.new_cache(), torch.cat([prompt, layout.token_ids[:, path]], 1))
        assert torch.equal(out.expert_ids[0, pos].sort(-1).values, branch.expert_ids[0, -1].sort(-1).values)


def test_gpt_oss_masks_match_layer_types(model_impl):
    model = build_hf(gpt_oss_config(sliding_window=4), seed=6)
    target = TargetModel(model, model_impl=model_impl)
    assert target.layer_types == ("sliding_attention", "full_attention") * 2 and target.sliding_window == 4
    ids = torch.randint(0, 128, (1, 20), generator=torch.Generator().manual_seed(6))
    cache = target.new_cache()
    out = target.prefill(cache, ids, all_logits=True)  # 20 tokens >> window 4
    torch.testing.assert_close(out.logits[0], plain_logits(model, ids), atol=ATOL, rtol=0)


def test_load_round_trip_and_metadata(saved_qwen, model_impl):
    path, model = saved_qwen
    target = TargetModel.load(path, model_impl=model_impl)
    assert target.model_impl == model_impl
    ids = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(7))
    out = target.prefill(target.new_cache(), ids)
    torch.testing.assert_close(out.logits[0, -1], plain_logits(model, ids)[-1], atol=ATOL, rtol=0)
    assert target.moe_layers == (0, 1, 2) and target.num_experts == 8 and target.experts_per_token == 2
    assert target.capture_layers == (2, 1, 0)
    assert target.kv_bytes_per_token == 2 * 3 * 2 * 16 * 4


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_bad_checkpoints_fail_early_with_clear_errors(saved_qwen, tmp_path):
    path, _ = saved_qwen
    with pytest.raises(FileNotFoundError, match="not found"):
        TargetModel.load(tmp_path / "nope")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        TargetModel.load(empty)
    pickle_only = _copy(path, tmp_path / "bin")
    (pickle_only / "model.safetensors").rename(pickle_only / "pytorch_model.bin")
    with pytest.raises(ValueError, match="only pickle weights"):
        TargetModel.load(pickle_only)
    corrupt = _copy(path, tmp_path / "corrupt")
    data = (corrupt / "model.safetensors").read_bytes()
    (corrupt / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="corrupt"):
        TargetModel.load(corrupt)
    dense = _copy(path, tmp_path / "dense")
    cfg = json.loads((dense / "config.json").read_text())
    cfg["architectures"] = ["LlamaForCausalLM"]
    (dense / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported target architecture 'LlamaForCausalLM'"):
        TargetModel.load(dense)


def test_bad_calls_raise(saved_qwen, model_impl):
    _, model = saved_qwen
    target = TargetModel(model, model_impl=model_impl)
    cache = target.new_cache()
    with pytest.raises(ValueError, match="token ids must lie"):
        target.prefill(cache, torch.tensor([[5, 128]]))
    with pytest.raises(ValueError, match=r"\[1, T>0\]"):
        target.prefill(cache, torch.zeros(1, 0, dtype=torch.int64))
    target.prefill(cache, torch.tensor([[1, 2, 3]]))
    with pytest.raises(ValueError, match="without a pending verify"):
        target.commit(cache, torch.tensor([1]))
    layout = build_layout(DraftTree.from_parents(torch.tensor([[4, 5]]), torch.tensor([[-1, 0]]), torch.ones(1, 2) * .5),
                          torch.tensor([[0, 1]]), torch.tensor([9]))
    target.verify(cache, layout)
    with pytest.raises(ValueError, match="uncommitted"):
        target.prefill(cache, torch.tensor([[1]]))
    with pytest.raises(ValueError, match="out of the layout range"):
        target.commit(cache, torch.tensor([3]))


def test_discard_drops_the_verify_slots(saved_qwen, model_impl):
    _, model = saved_qwen
    target = TargetModel(model, model_impl=model_impl)
    ids = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(8))
    cache = target.new_cache()
    target.prefill(cache, ids[:, :-1])
    layout = build_layout(random_tree(5, 128, torch.Generator().manual_seed(8)), torch.arange(5)[None], ids[:, -1])
    target.verify(cache, layout)
    target.discard(cache)
    assert cache.num_pending == 0 and cache.num_tokens == 5
    if model_impl == "hf":
        assert all(layer.keys.shape[2] == 5 for layer in cache.kv.layers)
    out = target.prefill(cache, ids[:, -1:])
    torch.testing.assert_close(out.logits[0, -1], plain_logits(model, ids)[-1], atol=ATOL, rtol=0)


def test_unknown_model_impl_is_a_clear_error(saved_qwen):
    path, model = saved_qwen
    with pytest.raises(ValueError, match="model_impl must be one of lean, hf"):
        TargetModel.load(path, model_impl="vllm")
    with pytest.raises(ValueError, match="model_impl must be one of"):
        TargetModel(model, model_impl="")
