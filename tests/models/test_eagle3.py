"""EAGLE-3 drafter: checkpoint round trip, size checks, tree drafting exactness and cache consistency."""

import json

import pytest
import torch
from safetensors.torch import load_file

from trtllm_moespec.core.layout import build_layout
from trtllm_moespec.models.eagle3 import Eagle3Config, load_eagle3, write_random_drafter
from trtllm_moespec.models.target import TargetModel

from .conftest import build_hf, gpt_oss_config, qwen3_moe_config

ATOL = 2e-4


@pytest.fixture(scope="module")
def target():
    return TargetModel(build_hf(qwen3_moe_config(), seed=11))


@pytest.fixture(scope="module")
def drafter(target, tmp_path_factory):
    path = write_random_drafter(target.config, tmp_path_factory.mktemp("eagle3"), seed=3, draft_vocab_size=96,
                                with_embeddings=False, init_std=0.2)
    return load_eagle3(path, target=target)


def test_round_trip_keeps_the_specforge_format(target, tmp_path):
    path = write_random_drafter(target.config, tmp_path / "d", seed=1, hidden_size=32, draft_vocab_size=64)
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert (cfg["draft_vocab_size"], cfg["target_hidden_size"], cfg["hidden_size"]) == (64, 64, 32)
    tensors = load_file(str(path / "model.safetensors"))
    assert tensors["fc.weight"].shape == (32, 3 * 64)
    assert tensors["midlayer.self_attn.q_proj.weight"].shape[1] == 2 * 32
    assert tensors["lm_head.weight"].shape == (64, 32)
    assert {"midlayer.hidden_norm.weight", "midlayer.input_layernorm.weight", "midlayer.post_attention_layernorm.weight",
            "midlayer.mlp.gate_proj.weight", "norm.weight", "embed_tokens.weight", "d2t", "t2d"} <= set(tensors)
    drafter = load_eagle3(path, target=target)
    for name, t in tensors.items():
        torch.testing.assert_close(drafter.state_dict()[name], t.to(drafter.state_dict()[name].dtype))
    hot = torch.arange(64) + tensors["d2t"]
    assert torch.equal(tensors["t2d"].nonzero()[:, 0], hot)  # d2t and t2d describe the same hot vocabulary
    assert torch.equal(drafter.to_target_ids(torch.arange(64)), hot)
    assert Eagle3Config.from_dict(cfg).to_dict()["draft_vocab_size"] == 64


def test_mismatched_drafter_is_rejected_naming_both_sizes(tmp_path):
    qwen = TargetModel(build_hf(qwen3_moe_config()))
    wide = TargetModel(build_hf(qwen3_moe_config(hidden_size=96)))
    path = write_random_drafter(wide.config, tmp_path / "wide")
    with pytest.raises(ValueError, match="target_hidden_size 96 != target hidden size 64"):
        load_eagle3(path, target=qwen)
    big_vocab = TargetModel(build_hf(qwen3_moe_config(vocab_size=256)))
    path = write_random_drafter(big_vocab.config, tmp_path / "vocab")
    with pytest.raises(ValueError, match="vocab_size 256 != target vocab_size 128"):
        load_eagle3(path, target=qwen)
    path = write_random_drafter(qwen.config, tmp_path / "noemb", hidden_size=32, with_embeddings=False)
    with pytest.raises(ValueError, match="hidden_size 32.*64"):
        load_eagle3(path, target=qwen)
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["LlamaForCausalLM"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="not an EAGLE-3 drafter"):
        load_eagle3(path, target=qwen)
    with pytest.raises(FileNotFoundError):
        load_eagle3(tmp_path / "missing", target=qwen)


def test_training_forward_equals_incremental_extend(target, drafter):
    ids = torch.randint(0, 128, (1, 9), generator=torch.Generator().manual_seed(0))
    hidden = target.prefill(target.new_cache(), ids).hidden
    with torch.no_grad():
        full = drafter(hidden, input_ids=ids)  # causal mask, positions 0..T-1: the SpecForge training form
    cache = drafter.new_cache()
    for t in range(9):
        drafter.extend(cache, ids[:, t:t + 1], hidden[:, t:t + 1])
        torch.testing.assert_close(cache.last_logits[0], full.logits[0, t], atol=ATOL, rtol=0)
    torch.testing.assert_close(cache.keys, full.keys, atol=ATOL, rtol=0)


def _prefilled(target, drafter, ids):
    tcache, dcache = target.new_cache(), drafter.new_cache()
    out = target.prefill(tcache, ids)
    root = int(out.logits[0, -1].argmax())
    drafter.prefill(dcache, ids, out.hidden, root)
    return tcache, dcache, root


def test_tree_drafting_equals_chain_drafting_on_every_branch(target, drafter):
    """Each node's children come from the drafter run as a plain chain along its path."""
    ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(1))
    _, dcache, _ = _prefilled(target, drafter, ids)
    steps, topk = 3, 3
    draft = drafter.draft_tree(dcache, steps=steps, topk=topk)
    tree = draft.tree
    tree.validate()
    assert tree.num_nodes == topk + (steps - 1) * topk ** 2 and draft.num_forwards == steps - 1
    assert dcache.num_tokens == 8  # drafting leaves the cache untouched
    S = dcache.num_tokens
    for v in range(tree.num_nodes):
        children = (tree.parents[0] == v).nonzero()[:, 0]
        if children.numel() == 0:
            continue
        path = [v]
        while tree.parents[0, path[0]] >= 0:
            path.insert(0, int(tree.parents[0, path[0]]))
        past, h = (dcache.keys, dcache.values), dcache.last_hidden[:, None]
        for depth, node in enumerate(path, start=1):  # plain causal chain: (token, previous hidden)
            with torch.no_grad():
                out = drafter(h, input_ids=tree.token_ids[:, [node]], position_ids=torch.tensor([[S - 1 + depth]]),
                              past_kv=past)
            past = (torch.cat([past[0], out.keys], 2), torch.cat([past[1], out.values], 2))
            h = out.hidden
        probs = torch.softmax(out.logits[0, -1], -1)
        top_p, top_d = probs.topk(topk)
        assert torch.equal(tree.token_ids[0, children], drafter.to_target_ids(top_d))
        torch.testing.assert_close(tree.draft_probs[0, children], top_p, atol=ATOL, rtol=0)
        torch.testing.assert_close(draft.node_hidden[0, children], h[0].expand(topk, -1), atol=ATOL, rtol=0)


def test_root_children_are_the_drafter_top_tokens_in_target_ids(target, drafter):
    ids = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(2))
    _, dcache, _ = _prefilled(target, drafter, ids)
    draft = drafter.draft_tree(dcache, steps=1, topk=4)
    top = torch.softmax(dcache.last_logits[0], -1).topk(4)
    assert torch.equal(draft.tree.token_ids[0], drafter.to_target_ids(top.indices))
    assert bool(drafter.t2d[draft.tree.token_ids[0]].all())


def test_cache_after_commit_equals_drafting_from_scratch(target, drafter):
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 128, (1, 7), generator=gen)
    tcache, dcache, root = _prefilled(target, drafter, ids)
    committed = torch.cat([ids, torch.tensor([[root]])], 1)
    for _ in range(3):
        draft = drafter.draft_tree(dcache, steps=3, topk=2)
        n = draft.tree.num_nodes
        layout = build_layout(draft.tree, torch.arange(n)[None], torch.tensor([root]))
        out = target.verify(tcache, layout)
        leaf = int(torch.randint(0, n + 1, (1,), generator=gen))  # any root->node path may be accepted
        accepted = torch.tensor([p for p in layout.paths[0, leaf].tolist()[1:] if p >= 0], dtype=torch.int64)
        bonus = int(out.logits[0, leaf].argmax())
        emitted = torch.cat([layout.token_ids[0, accepted], torch.tensor([bonus])])
        target.commit(tcache, accepted)
        drafter.commit(dcache, accepted, emitted, out.hidden)
        committed = torch.cat([committed, emitted[None]], 1)
        root = bonus
        # reference: a fresh target + drafter prefill on the committed sequence (root = last token)
        fresh = _scratch(target, drafter, committed)
        assert dcache.num_tokens == fresh.num_tokens == committed.shape[1] - 1
        torch.testing.assert_close(dcache.keys, fresh.keys, atol=ATOL, rtol=0)
        torch.testing.assert_close(dcache.values, fresh.values, atol=ATOL, rtol=0)
        torch.testing.assert_close(dcache.last_logits, fresh.last_logits, atol=ATOL, rtol=0)
        again = drafter.draft_tree(dcache, steps=3, topk=2).tree
        ref = drafter.draft_tree(fresh, steps=3, topk=2).tree
        assert torch.equal(again.token_ids, ref.token_ids) and torch.equal(again.parents, ref.parents)


def _scratch(target, drafter, committed):
    out = target.prefill(target.new_cache(), committed[:, :-1])
    cache = drafter.new_cache()
    drafter.prefill(cache, committed[:, :-1], out.hidden, int(committed[0, -1]))
    return cache


def test_ddd_stops_drafting_when_the_frontier_score_is_low(target, drafter):
    ids = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(4))
    _, dcache, _ = _prefilled(target, drafter, ids)
    full = drafter.draft_tree(dcache, steps=4, topk=2)
    never = drafter.draft_tree(dcache, steps=4, topk=2, ddd_threshold=0.0)
    always = drafter.draft_tree(dcache, steps=4, topk=2, ddd_threshold=2.0)  # frontier scores sum to <= 1
    assert never.num_forwards == full.num_forwards == 3 and torch.equal(never.tree.token_ids, full.tree.token_ids)
    assert always.num_forwards == 0 and always.tree.num_nodes == 2


def test_should_expand_rule_is_asked_before_every_expansion(target, drafter):
    ids = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(4))
    _, dcache, _ = _prefilled(target, drafter, ids)
    full = drafter.draft_tree(dcache, steps=4, topk=2)
    seen = []

    def two_expansions(tree, frontier):
        seen.append((tree.num_nodes, frontier.numel()))
        return len(seen) <= 2
    cut = drafter.draft_tree(dcache, steps=4, topk=2, should_expand=two_expansions)
    assert seen == [(2, 2), (6, 2), (10, 2)]  # asked with the tree so far and its frontier, before each step
    assert cut.num_forwards == 2 and torch.equal(cut.tree.token_ids, full.tree.token_ids[:, :10])


def test_drafter_works_on_gpt_oss_features(tmp_path):
    target = TargetModel(build_hf(gpt_oss_config(), seed=2))
    drafter = load_eagle3(write_random_drafter(target.config, tmp_path / "g"), target=target)
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(5))
    _, dcache, _ = _prefilled(target, drafter, ids)
    tree = drafter.draft_tree(dcache, steps=2, topk=3).tree
    tree.validate()
    assert tree.num_nodes == 3 + 9


def test_pruned_vocabulary_proposes_the_top_kept_tokens(target, tmp_path):
    full = load_eagle3(write_random_drafter(target.config, tmp_path / "p", seed=5), target=target)
    pruned = load_eagle3(tmp_path / "p", target=target)
    keep = torch.arange(0, 128, 3)  # every third target token
    pruned.prune_vocab(keep)
    assert pruned.config.draft_vocab_size == keep.numel() and int(pruned.t2d.sum()) == keep.numel()
    assert torch.equal(pruned.to_target_ids(torch.arange(keep.numel())), keep)
    ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(6))
    caches = []
    for d in (full, pruned):
        _, dcache, _ = _prefilled(target, d, ids)
        caches.append(dcache)
    # The pruned head's logits are the full head's logits at the kept tokens.
    torch.testing.assert_close(caches[1].last_logits[0], caches[0].last_logits[0, keep], atol=1e-5, rtol=0)
    tree = pruned.draft_tree(caches[1], steps=3, topk=4).tree
    assert bool(torch.isin(tree.token_ids[tree.valid], keep).all())
    full_logits = caches[0].last_logits[0, keep]
    assert torch.equal(tree.token_ids[0, :4], keep[full_logits.topk(4).indices])
    with pytest.raises(ValueError, match="empty draft vocabulary"):
        pruned.prune_vocab(torch.tensor([1]))  # 1 is not in the kept set


def test_fused_inference_forward_equals_the_unfused_layer(target, drafter):
    """No-grad forwards use concatenated q/k/v and gate/up weights; they must match the module math
    (the grad path), also after a weight changes in place (the fused copies are rebuilt)."""
    ids = torch.randint(0, 128, (1, 7), generator=torch.Generator().manual_seed(5))
    hidden = target.prefill(target.new_cache(), ids).hidden

    def both():
        with torch.no_grad():
            fused = drafter(hidden, input_ids=ids)
        with torch.enable_grad():
            plain = drafter(hidden, input_ids=ids)
        for name in ("logits", "hidden", "keys", "values"):
            torch.testing.assert_close(getattr(fused, name), getattr(plain, name).detach(), atol=1e-5, rtol=1e-5)
        return fused

    before = both()
    weight = drafter.midlayer.self_attn.k_proj.weight
    saved = weight.detach().clone()
    with torch.no_grad():
        weight.mul_(1.5)
    try:
        after = both()
        assert not torch.allclose(after.keys, before.keys)  # the rebuilt fused weights saw the change
    finally:
        with torch.no_grad():
            weight.copy_(saved)
    torch.testing.assert_close(both().logits, before.logits, atol=0, rtol=0)
