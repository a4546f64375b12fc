"""EAGLE-3 drafter training: the training-time test equals inference chain drafting, a few
real optimizer steps reduce the distillation loss, and the exported drafter loads on its target."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from trtllm_moespec.models.eagle3 import load_eagle3, write_random_drafter
from trtllm_moespec.models.target import TargetModel
from trtllm_moespec.training.features import target_features, ttt_mask, ttt_unroll
from trtllm_moespec.training.train_eagle3 import (Eagle3TrainConfig, distill_loss, export_eagle3, init_drafter,
                                                   save_drafter, train_eagle3, trainable_parameters)

VOCAB = 128


def _tiny_target(seed: int = 0) -> Qwen3MoeForCausalLM:
    torch.manual_seed(seed)
    config = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            num_experts=8, num_experts_per_tok=2, max_position_embeddings=256,
                            initializer_range=0.1, tie_word_embeddings=True)
    return Qwen3MoeForCausalLM(config).eval()


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny_target")
    _tiny_target().save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def target(target_dir) -> TargetModel:
    return TargetModel.load(target_dir)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    """Token streams with some structure (a noisy counter), in the train_tiny data format."""
    path = tmp_path_factory.mktemp("data")
    rng = np.random.default_rng(0)
    for name, n in (("train", 6000), ("heldout", 1200)):
        stream = (np.arange(n) * 7 + rng.integers(0, 3, n)) % VOCAB
        np.save(path / f"{name}.npy", stream.astype(np.uint16))
    (path / "bytes.txt").write_text("24000 4800\n")
    return path


def test_ttt_mask_is_the_chain_tree_mask() -> None:
    m = ttt_mask(5, 2, torch.float32, "cpu")[0, 0] == 0  # [T, 3T] allowed
    t = 4  # chain started at committed position 2: prefix 0..2, step-1 key at 3, step-2 key (itself) at 4
    assert m[t, :5].tolist() == [True, True, True, False, False]
    assert m[t, 5:10].tolist() == [False, False, False, True, False]
    assert m[t, 10:].tolist() == [False, False, False, False, True]


def test_ttt_unroll_equals_inference_chain_drafting(target) -> None:
    """Step k at position n-1+k reproduces the hidden and the proposal of the depth-(k+1) node of
    `draft_tree(steps=4, topk=1)` after a prefill of n tokens."""
    torch.manual_seed(1)
    path = write_random_drafter(target.config, Path(__import__("tempfile").mkdtemp()) / "d", seed=2,
                                with_embeddings=False, init_std=0.2)
    drafter = load_eagle3(path, target=target)
    prompt = torch.randint(0, VOCAB, (1, 12))
    n, root = prompt.shape[1], 5
    pre = target.prefill(target.new_cache(), prompt)
    cache = drafter.new_cache()
    drafter.prefill(cache, prompt, pre.hidden, next_token=root)
    draft = drafter.draft_tree(cache, steps=4, topk=1)
    chain = draft.tree.token_ids[0]  # node d-1 has depth d
    assert draft.tree.depth[0].tolist() == [1, 2, 3, 4]
    tokens = torch.cat([prompt[:, 1:], torch.tensor([[root]]), chain[None, :3]], dim=1)  # [1, n+3]
    hidden = torch.cat([pre.hidden, torch.randn(1, 3, pre.hidden.shape[-1])], dim=1)  # after n-1: never used
    with torch.no_grad():
        outs = ttt_unroll(drafter, hidden, tokens, num_steps=4)
    for k in range(4):
        torch.testing.assert_close(outs[k].hidden[0, n - 1 + k], draft.node_hidden[0, k], atol=2e-5, rtol=1e-4)
        assert int(outs[k].logits[0, n - 1 + k].argmax()) == int(chain[k])


def test_target_features_match_the_engine_prefill(target) -> None:
    ids = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(3))
    feats = target_features(target, ids)
    for b in range(2):
        pre = target.prefill(target.new_cache(), ids[b : b + 1], all_logits=True)
        torch.testing.assert_close(feats.hidden[b], pre.hidden[0], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(feats.logits[b], pre.logits[0], atol=1e-4, rtol=1e-4)
        assert torch.equal(feats.expert_ids[b].sort(-1).values, pre.expert_ids[0].sort(-1).values)


def test_a_few_steps_reduce_the_distillation_loss(target, data_dir) -> None:
    cfg = Eagle3TrainConfig(seq_len=24, batch_size=4, ttt_steps=3, intermediate_size=64, num_attention_heads=2,
                            num_key_value_heads=1, head_dim=32, peak_lr=3e-3, selfgen_sequences=0)
    drafter = init_drafter(target, cfg).train()
    opt = torch.optim.AdamW(trainable_parameters(drafter), lr=cfg.peak_lr)
    windows = torch.from_numpy(np.load(data_dir / "train.npy")[: 4 * 24].reshape(4, 24).astype(np.int64))
    embed_before = target.input_embeddings().weight.clone()
    first, _ = distill_loss(drafter, target, windows, cfg)
    for _ in range(25):
        loss, metrics = distill_loss(drafter, target, windows, cfg)
        opt.zero_grad()
        loss.backward()
        opt.step()
    last, metrics = distill_loss(drafter, target, windows, cfg)
    assert last.item() < 0.5 * first.item()  # KL: 0 = the drafter matches the target
    assert len(metrics.step_loss) == 3 and all(0 <= a <= 1 for a in metrics.step_acc)
    assert torch.equal(target.input_embeddings().weight, embed_before)  # the shared embedding stays frozen


def test_train_resume_export_and_load(target_dir, data_dir, tmp_path) -> None:
    cfg = Eagle3TrainConfig(minutes=5, seq_len=24, batch_size=2, ttt_steps=2, intermediate_size=64,
                            num_attention_heads=2, num_key_value_heads=1, head_dim=32, eval_windows=2,
                            selfgen_sequences=3, selfgen_prompt_len=8)
    run = tmp_path / "run"
    _, progress = train_eagle3(target_dir, data_dir, run, cfg, resume=False, max_steps=2)
    assert progress.step == 2 and (run / "train.log").is_file()
    selfgen = np.load(run / "selfgen.npy")  # corpus prefix + the target's greedy continuation
    assert selfgen.shape == (3, 24)
    model = TargetModel.load(target_dir).model
    with torch.no_grad():
        for t in range(8, 24):
            prefix = torch.from_numpy(selfgen[:, :t].astype(np.int64))
            assert torch.equal(model(input_ids=prefix).logits[:, -1].argmax(-1), prefix.new_tensor(selfgen[:, t]))
    trained, progress = train_eagle3(target_dir, data_dir, run, cfg, resume=True, max_steps=4)
    assert progress.step == 4 and "resumed at step 2" in (run / "train.log").read_text()
    out = export_eagle3(run, target_dir, tmp_path / "eagle3", dtype=torch.float32)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == VOCAB
    tensors = load_file(str(out / "model.safetensors"))
    assert "embed_tokens.weight" not in tensors and torch.equal(tensors["d2t"], torch.zeros(VOCAB, dtype=torch.int64))
    loaded_target = TargetModel.load(target_dir)
    loaded = load_eagle3(out, target=loaded_target)
    hidden, ids = torch.randn(1, 6, 3 * 64), torch.randint(0, VOCAB, (1, 6))
    with torch.no_grad():
        torch.testing.assert_close(loaded(hidden, input_ids=ids).logits, trained(hidden, input_ids=ids).logits)
    with pytest.raises(ValueError, match="vocab_size"):
        load_eagle3(out, target=TargetModel(Qwen3MoeForCausalLM(Qwen3MoeConfig(
            vocab_size=VOCAB * 2, hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16))))
    # a finished run keeps training in an appended cosine segment (the target was trained further)
    _, extended = train_eagle3(target_dir, data_dir, run, replace(cfg, extend_minutes=1.0), resume=True, max_steps=5)
    assert extended.step == 5 and extended.segment_start_s == progress.elapsed_s
    assert extended.planned_s == pytest.approx(progress.elapsed_s + 60) and extended.segment_peak_lr == 1e-3


ASSETS = Path(__file__).resolve().parents[2] / "trtllm_moespec" / "assets" / "moespec-tiny"


def test_shipped_drafter_and_head_predictor_load_on_the_shipped_target() -> None:
    assert (ASSETS / "eagle3" / "config.json").is_file(), f"shipped drafter missing at {ASSETS / 'eagle3'}"
    from trtllm_moespec.resolve import ModelPaths, load_predictor
    from trtllm_moespec.engine.predictors import HeadExperts

    target = TargetModel.load(ASSETS / "target")
    drafter = load_eagle3(ASSETS / "eagle3", target=target)
    assert drafter.embed_tokens is target.input_embeddings()  # shared, not shipped
    tensors = load_file(str(ASSETS / "eagle3" / "model.safetensors"))
    assert "embed_tokens.weight" not in tensors and tensors["fc.weight"].dtype == torch.float16
    paths = ModelPaths(ASSETS / "target", ASSETS / "eagle3", ASSETS / "predictor-head", "moespec-tiny", ASSETS / "x")
    assert isinstance(load_predictor(None, paths, target, drafter), HeadExperts)
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    pre = target.prefill(target.new_cache(), ids)
    cache = drafter.new_cache()
    drafter.prefill(cache, ids, pre.hidden, next_token=int(pre.logits[0, -1].argmax()))
    assert drafter.draft_tree(cache, steps=4, topk=8).tree.num_nodes == 8 + 3 * 64


def test_a_new_run_warm_starts_from_an_exported_pruned_drafter(target, target_dir, data_dir, tmp_path) -> None:
    """A later segment on a fresh machine starts from the shipped (pruned, fp16) drafter: every weight
    carries over, the kept tokens' lm_head rows land on their target ids, the others keep the target's
    head, and a drafter of another shape is refused by name."""
    cfg = Eagle3TrainConfig(minutes=5, seq_len=24, batch_size=2, ttt_steps=2, intermediate_size=64,
                            num_attention_heads=2, num_key_value_heads=1, head_dim=32, eval_windows=2)
    source = init_drafter(target, cfg)
    with torch.no_grad():
        for p in trainable_parameters(source):
            p.normal_(std=0.3)
    keep = torch.tensor([5, 17, 3, 99, 64, 120])  # target ids of a pruned draft vocabulary
    source.prune_vocab(keep)
    exported = save_drafter(source, tmp_path / "shipped", dtype=torch.float32)
    run = tmp_path / "run"
    _, progress = train_eagle3(target_dir, data_dir, run, replace(cfg, init_from=str(exported)), resume=False,
                               max_steps=0)
    assert progress.step == 0 and "warm start from" in (run / "train.log").read_text()
    state = load_file(str(run / "ckpt" / "model.safetensors"))
    for name, value in source.state_dict().items():
        if name not in ("lm_head.weight", "d2t", "t2d") and not name.startswith("embed_tokens."):
            assert torch.equal(state[name], value), name
    ids = source.draft_vocab_target_ids()
    assert sorted(ids.tolist()) == sorted(keep.tolist())
    assert torch.equal(state["lm_head.weight"][ids], source.lm_head.weight)
    others = torch.ones(VOCAB, dtype=torch.bool)
    others[keep] = False
    assert torch.equal(state["lm_head.weight"][others], target.model.get_output_embeddings().weight[others])
    with pytest.raises(ValueError, match="intermediate_size"):
        train_eagle3(target_dir, data_dir, tmp_path / "run2",
                     replace(cfg, intermediate_size=96, init_from=str(exported)), resume=False, max_steps=0)
