"""The lean forward: a batch of B requests equals B single-request runs, its masks equal the
reference layout masks, and the static cache's slots, growth and commit gather behave."""

import pytest
import torch

from trtllm_moespec.core.layout import build_layout
from trtllm_moespec.core.tree import DraftTree
from trtllm_moespec.models.kv_cache import StaticKVCache
from trtllm_moespec.models.lean_attention import build_masks
from trtllm_moespec.models.lean_forward import ForwardBatch
from trtllm_moespec.models.target import TargetModel

from .conftest import build_hf, gpt_oss_config, qwen3_moe_config


def _tree(n: int, seed: int) -> DraftTree:
    gen = torch.Generator().manual_seed(seed)
    parents = torch.tensor([[int(torch.randint(-1, i, (1,), generator=gen)) if i else -1 for i in range(n)]])
    return DraftTree.from_parents(torch.randint(0, 128, (1, n), generator=gen), parents, torch.full((1, n), 0.5))


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_batch_of_two_equals_two_single_runs(arch):
    """Different prompt lengths, slots in reverse order, tree masks: B=2 == B=1 twice."""
    config = qwen3_moe_config() if arch == "qwen3_moe" else gpt_oss_config()
    target = TargetModel(build_hf(config), model_impl="lean")
    lean = target.lean
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 128, (1, 11), generator=gen), torch.randint(0, 128, (1, 5), generator=gen)]
    layouts = [build_layout(_tree(6, s), torch.arange(6)[None], torch.tensor([3 + s])) for s in (1, 2)]

    single = []
    for prompt, layout in zip(prompts, layouts):
        pool = lean.new_cache(64)
        lean.forward(pool, ForwardBatch(prompt, torch.arange(prompt.shape[1])[None], (0,), (0,)))
        P = prompt.shape[1]
        single.append(lean.forward(pool, ForwardBatch(layout.token_ids, layout.position_ids(P), (0,), (P,),
                                                      layout.tree_mask())))

    pool = lean.new_cache(64, num_slots=2)
    for slot, prompt in zip((1, 0), prompts):  # prefill each request into its own slot
        lean.forward(pool, ForwardBatch(prompt, torch.arange(prompt.shape[1])[None], (slot,), (0,)))
    P = tuple(p.shape[1] for p in prompts)
    batch = ForwardBatch(
        torch.cat([l.token_ids for l in layouts]), torch.cat([l.position_ids(p) for l, p in zip(layouts, P)]),
        (1, 0), P, torch.cat([l.tree_mask() for l in layouts]))
    both = lean.forward(pool, batch)
    for b in range(2):
        torch.testing.assert_close(both.logits[b], single[b].logits[0], atol=1e-5, rtol=0)
        torch.testing.assert_close(both.hidden[b], single[b].hidden[0], atol=1e-5, rtol=0)
        assert torch.equal(both.expert_ids[b], single[b].expert_ids[0])


@pytest.mark.parametrize("window", [None, 3])
def test_masks_equal_the_layout_attention_mask(window):
    """Lean masks over cache indices [start, end) == TreeLayout.attention_mask restricted to them."""
    P = 9
    layout = build_layout(_tree(7, 4), torch.tensor([[0, 1, 2, 3, 4, 5, 6]]), torch.tensor([1]))
    masks = build_masks((P,), layout.position_ids(P), layout.tree_mask(), torch.float32, window)
    ref = layout.attention_mask(P, torch.float32, window)  # [1, 1, T, P + T]
    torch.testing.assert_close(masks.full, layout.attention_mask(P, torch.float32, None))
    if window is not None:
        assert masks.sliding_start == P - window + 1
        torch.testing.assert_close(masks.sliding, ref[..., masks.sliding_start:])
        assert bool((ref[..., :masks.sliding_start] < 0).all())  # nothing before the start was visible


def test_single_token_step_needs_no_full_mask():
    masks = build_masks((12,), torch.tensor([[12]]), None, torch.float32, None)
    assert masks.full is None and masks.end == 13


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # through numpy, and through torch
def test_static_cache_commit_gathers_accepted_slots_in_every_layer(dtype):
    cache = StaticKVCache(num_layers=2, num_kv_heads=2, head_dim=2, max_len=8, num_slots=2, dtype=dtype)
    cache.kv.copy_(torch.arange(cache.kv.numel(), dtype=torch.float32).view_as(cache.kv))
    before = cache.kv.clone()
    cache.commit(1, 3, torch.tensor([3, 5, 6]))  # root at 3 stays, nodes at 5 and 6 move to 4 and 5
    assert torch.equal(cache.kv[:, :, 1, :, 3:6], before[:, :, 1, :, [3, 5, 6]])
    assert torch.equal(cache.kv[:, :, 1, :, :3], before[:, :, 1, :, :3])
    assert torch.equal(cache.kv[:, :, 0], before[:, :, 0])  # another request's slot is untouched
    chain = cache.kv.clone()
    cache.commit(1, 3, torch.tensor([3, 4, 5]))  # already in place: nothing moves
    assert torch.equal(cache.kv, chain)
    cache.commit(1, 2, torch.tensor([2, 6]))  # the root in place, one node from further down
    assert torch.equal(cache.kv[:, :, 1, :, 3], chain[:, :, 1, :, 6])


def test_static_cache_slots_are_reused_and_capacity_grows():
    cache = StaticKVCache(num_layers=1, num_kv_heads=1, head_dim=2, max_len=4, max_len_cap=10)
    a, b = cache.acquire(), cache.acquire()  # the second acquire grows the pool
    assert (a, b) == (0, 1) and cache.num_slots == 2
    cache.kv[0, 0, 0, 0, 3] = 7.0  # layer 0, keys, slot 0, head 0, position 3
    cache.ensure_len(6)
    assert cache.max_len == 8 and bool((cache.kv[0, 0, 0, 0, 3] == 7.0).all())  # contents survive growth
    cache.ensure_len(10)
    assert cache.max_len == 10
    with pytest.raises(ValueError, match="exceeds the model's maximum of 10"):
        cache.ensure_len(11)
    cache.release(a)
    assert cache.acquire() == a


def test_the_lowest_free_slot_goes_first_so_slots_in_use_stay_a_block():
    cache = StaticKVCache(num_layers=1, num_kv_heads=1, head_dim=2, max_len=4, num_slots=4)
    slots = [cache.acquire() for _ in range(4)]
    assert slots == [0, 1, 2, 3]
    for s in (2, 0, 3):  # requests finish in any order
        cache.release(s)
    assert [cache.acquire() for _ in range(3)] == [0, 2, 3]  # the block 0..3 is whole again


def test_a_batch_in_any_slot_order_reads_views_and_returns_outputs_in_its_own_order(saved_qwen, monkeypatch):
    """verify_batch runs its rows in slot order, so a consecutive block of slots is read as one view
    (no gather of every request's K/V), and hands each caller's output back in the caller's order."""
    from trtllm_moespec.core.layout import root_layout
    from trtllm_moespec.engine.batch import verify_batch
    from trtllm_moespec.models import lean_forward

    _, model = saved_qwen
    target = TargetModel(model, model_impl="lean")
    prompts = [torch.randint(0, 128, (1, n), generator=torch.Generator().manual_seed(n)) for n in (5, 7, 6)]
    caches = [target.new_cache() for _ in prompts]
    alone = [target.new_cache() for _ in prompts]
    for c, a, p in zip(caches, alone, prompts):
        target.prefill(c, p)
        target.prefill(a, p)
    gathers = []
    original = lean_forward._HostIndexedIO.write_and_read

    def spy(self, *args):
        keys, values = original(self, *args)
        gathers.append(keys._base is None)  # a gather makes a new tensor, a view has a base
        return keys, values
    monkeypatch.setattr(lean_forward._HostIndexedIO, "write_and_read", spy)
    shuffled = [2, 0, 1]  # callers' order differs from slot order
    layouts = [root_layout(torch.tensor([3 + b])) for b in shuffled]
    outs = verify_batch(target, [caches[b] for b in shuffled], layouts)
    assert gathers and not any(gathers)
    for out, b, layout in zip(outs, shuffled, layouts):
        ref = target.verify(alone[b], layout)
        torch.testing.assert_close(out.logits, ref.logits, atol=2e-5, rtol=0)
        assert torch.equal(out.expert_ids, ref.expert_ids)


def test_lean_requests_release_their_slots(saved_qwen):
    _, model = saved_qwen
    target = TargetModel(model, model_impl="lean")
    first = target.new_cache()
    second = target.new_cache()
    assert {first.slot, second.slot} == {0, 1}
    slot = first.slot
    del first
    assert target.new_cache().slot == slot  # a finished request's slot goes back to the pool


def test_long_generation_grows_the_cache_and_stays_exact(saved_qwen):
    """A request longer than the initial cache length: growth keeps every committed key."""
    _, model = saved_qwen
    target = TargetModel(model, model_impl="lean")
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(3))
    target._pool = target.lean.new_cache(8, max_len_cap=512)  # start tiny so the request must grow it
    cache = target.new_cache()
    target.prefill(cache, ids[:, :30])
    for t in range(30, 40):
        out = target.prefill(cache, ids[:, t:t + 1])
    with torch.no_grad():
        ref = model(ids).logits[0, -1]
    assert target._pool.max_len >= 40
    torch.testing.assert_close(out.logits[0, -1], ref, atol=2e-4, rtol=0)


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_static_shape_forward_equals_the_eager_forward(arch):
    """forward_static (what the CUDA graphs capture: tensor prefix length, whole-cache attention)
    gives the eager forward's outputs, with a padded bucket's extra rows ignored."""
    config = qwen3_moe_config() if arch == "qwen3_moe" else gpt_oss_config()
    lean = TargetModel(build_hf(config, seed=3), model_impl="lean").lean
    prompt = torch.randint(0, 128, (1, 13), generator=torch.Generator().manual_seed(3))
    layout = build_layout(_tree(5, 7), torch.arange(5)[None], torch.tensor([9]))
    P, T, bucket = 13, 6, 8
    outs = []
    for static in (False, True):
        pool = lean.new_cache(64)
        lean.forward(pool, ForwardBatch(prompt, torch.arange(P)[None], (0,), (0,)))
        if not static:
            outs.append(lean.forward(pool, ForwardBatch(layout.token_ids, layout.position_ids(P), (0,), (P,),
                                                        layout.tree_mask())))
            continue
        ids = torch.cat([layout.token_ids, torch.zeros(1, bucket - T, dtype=torch.int64)], 1)
        pos = torch.cat([layout.position_ids(P), torch.full((1, bucket - T), P)], 1)
        mask = torch.eye(bucket, dtype=torch.bool)[None].clone()
        mask[:, :T, :T] = layout.tree_mask()
        out = lean.forward_static(pool, ids, pos, (0,), torch.tensor([P]), mask)
        outs.append(out)
    torch.testing.assert_close(outs[1].logits[:, :T], outs[0].logits, atol=1e-5, rtol=0)
    assert torch.equal(outs[1].expert_ids[:, :T], outs[0].expert_ids)


def test_a_tree_at_the_position_limit_fits_in_the_cache():
    """Cache indices are not positions: tree slots past max_position_embeddings must still fit."""
    model = build_hf(qwen3_moe_config(max_position_embeddings=32), seed=4)
    target = TargetModel(model, model_impl="lean")
    ids = torch.randint(0, 128, (1, 30), generator=torch.Generator().manual_seed(4))
    cache = target.new_cache()
    target.prefill(cache, ids)
    parents = torch.tensor([[-1, -1, -1, 0, 0, 1, 1, 2]])  # depth <= 2: positions <= 32, cache indices up to 38
    tree = DraftTree.from_parents(torch.arange(8)[None], parents, torch.full((1, 8), 0.5))
    out = target.verify(cache, build_layout(tree, torch.arange(8)[None], torch.tensor([5])))
    assert out.logits.shape == (1, 9, 128) and bool(torch.isfinite(out.logits).all())


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
@pytest.mark.parametrize("num_tokens", [1, 2, 5])
def test_looped_experts_equal_the_grouped_gemm(arch, num_tokens):
    """The CPU per-expert matmul paths (one token; a few pairs) compute the same layer output as
    the grouped GEMM, biases and clamped SwiGLU included."""
    from trtllm_moespec.models.moe import gpt_oss_weights, qwen3_moe_weights, route, routed_experts

    config = qwen3_moe_config() if arch == "qwen3_moe" else gpt_oss_config()
    mlp = build_hf(config).model.layers[0].mlp
    router, experts = gpt_oss_weights(mlp) if arch == "gpt_oss" else qwen3_moe_weights(mlp)
    x = torch.randn(num_tokens, config.hidden_size, generator=torch.Generator().manual_seed(num_tokens))
    ids, weights = route(x, router)
    grouped = routed_experts(x, ids, weights, experts, looped=False)
    looped = routed_experts(x, ids, weights, experts, looped=True)
    torch.testing.assert_close(looped, grouped, atol=1e-6, rtol=0)
    assert looped.abs().sum() > 0  # the layer really computed something


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_the_gathered_matmul_equals_the_grouped_gemm(arch, monkeypatch):
    """On CUDA, where torch's grouped GEMM reads its group offsets on the host (any dtype but bf16 on
    sm90/sm100), a verify forward runs each (token, expert) pair as one batched matmul over gathered
    expert weights, so a CUDA graph can capture it. Run here on CPU tensors: the same layer output."""
    from trtllm_moespec.models import moe
    from trtllm_moespec.models.moe import gpt_oss_weights, qwen3_moe_weights, route, routed_experts

    config = qwen3_moe_config() if arch == "qwen3_moe" else gpt_oss_config()
    mlp = build_hf(config).model.layers[0].mlp
    router, experts = gpt_oss_weights(mlp) if arch == "gpt_oss" else qwen3_moe_weights(mlp)
    x = torch.randn(9, config.hidden_size, generator=torch.Generator().manual_seed(3))
    ids, weights = route(x, router)
    grouped = routed_experts(x, ids, weights, experts, looped=False)
    calls, matmul = [], moe.gathered_matmul
    monkeypatch.setattr(moe, "_gathers", lambda weight, pairs: True)  # the CUDA branch, on CPU tensors
    monkeypatch.setattr(moe, "gathered_matmul", lambda x, w, e: calls.append(len(e)) or matmul(x, w, e))
    torch.testing.assert_close(routed_experts(x, ids, weights, experts, looped=False), grouped, atol=1e-5, rtol=0)
    assert calls == [ids.numel(), ids.numel()]  # gate_up and down both gathered
