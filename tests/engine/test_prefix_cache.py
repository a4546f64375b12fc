"""Prompt prefix caching: a prompt that begins like a finished one reuses that prefix's K/V and
decodes exactly what a full prefill gives (greedy and seeded sampling, both architectures,
GPT-OSS past its sliding window, one request at a time and batched); the cache keeps at most
its bound of prompts and gives evicted slots back."""

from __future__ import annotations

import gc

import pytest
import torch

from trtllm_moespec import LLM, SamplingParams
from trtllm_moespec.engine.batch import BatchedEngine
from trtllm_moespec.engine.prefix_cache import PrefixCache

SHARED = [(7 * i + 3) % 120 + 1 for i in range(30)]  # 30 tokens: past the GPT-OSS test window (8)
TURNS = [SHARED + [5, 9, 11], SHARED + [5, 9, 11, 40, 41], SHARED + [77], [1, 2, 3] + SHARED]  # the last shares nothing
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=12, temperature=0.9, top_k=20, seed=4, ignore_eos=True)


def _llm(checkpoints, arch, policy, **kw):
    target, draft = checkpoints[arch]
    return LLM(str(target), draft_model=str(draft), policy=policy, **kw)


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
@pytest.mark.parametrize("policy", ["ar", "eagle3", "joint"])
def test_reused_prefixes_decode_what_a_full_prefill_does(checkpoints, arch, policy):
    kw = {"predictor": "oracle"} if policy == "joint" else {}
    plain = _llm(checkpoints, arch, policy, **kw)
    for params in (GREEDY, SAMPLED):
        cached = _llm(checkpoints, arch, policy, prefix_cache=2, **kw)
        want = [plain.generate([p], params)[0].token_ids for p in TURNS]
        assert [cached.generate([p], params)[0].token_ids for p in TURNS] == want
        pc = cached.engine.prefix_cache
        # turn 1 is cold; turn 2 reuses all 33 tokens of turn 1's prompt, turn 3 the 30 it shares with
        # turn 2's (the longest); turn 4 shares no prefix
        assert (pc.hits, pc.misses, pc.reused_tokens) == (2, 2, 33 + 30)
        assert len(pc) == 2


def test_batched_requests_reuse_prefixes_and_stay_exact(checkpoints):
    plain = _llm(checkpoints, "qwen3_moe", "eagle3")
    cached = _llm(checkpoints, "qwen3_moe", "eagle3", prefix_cache=4)
    want = [plain.generate([p], GREEDY)[0].token_ids for p in TURNS]
    first = cached.make_request(TURNS[0], GREEDY)
    BatchedEngine(cached.engine, max_batch_size=3).run_all([first])  # cached when it finishes
    requests = [cached.make_request(p, GREEDY) for p in TURNS[1:]]
    BatchedEngine(cached.engine, max_batch_size=3).run_all(requests)  # admitted together: two hits, one miss
    assert [first.output_ids] + [r.output_ids for r in requests] == want
    pc = cached.engine.prefix_cache
    assert (pc.hits, pc.misses) == (2, 2)


@pytest.mark.parametrize("policy", ["ar", "eagle3"])
def test_a_chats_next_turn_reuses_the_previous_prompt_and_answer(checkpoints, policy):
    """Turn 2 resends turn 1's prompt and answer: all of it but the answer's last token (whose K/V
    no forward computed) is reused, and turn 2's entry replaces turn 1's."""
    plain, cached = _llm(checkpoints, "gpt_oss", policy), _llm(checkpoints, "gpt_oss", policy, prefix_cache=4)
    first = cached.generate([TURNS[0]], GREEDY)[0]
    assert first.token_ids == plain.generate([TURNS[0]], GREEDY)[0].token_ids
    second = TURNS[0] + first.token_ids + [40, 41]
    assert cached.generate([second], GREEDY)[0].token_ids == plain.generate([second], GREEDY)[0].token_ids
    pc = cached.engine.prefix_cache
    assert pc.reused_tokens == len(TURNS[0]) + len(first.token_ids) - 1 and len(pc) == 1


def test_the_longest_shared_prefix_is_reused_but_never_the_whole_prompt(checkpoints):
    llm = _llm(checkpoints, "qwen3_moe", "ar", prefix_cache=4)
    pc = llm.engine.prefix_cache
    out = llm.generate([TURNS[0]], GREEDY)[0]
    kept = TURNS[0] + out.token_ids[:-1]
    llm.generate([SHARED + [99] * 4], GREEDY)  # shares 30 tokens: a second entry
    assert len(pc) == 2
    assert pc.match(kept + [3])[1] == len(kept)  # the longest match wins
    assert pc.match(kept)[1] == len(kept) - 1  # the last prompt token is always run: its logits
    assert pc.match(SHARED[:10] + [0] * 20)[0] is None  # fewer shared tokens than min_tokens (16)


def test_an_entry_keeps_only_the_tokens_left_after_a_stop_string(checkpoints):
    """A stop string can cut output tokens whose K/V were committed: the entry ends at the kept ones."""
    from trtllm_moespec.engine.prefix_cache import SequenceFeatures

    llm = _llm(checkpoints, "qwen3_moe", "ar")
    pc = PrefixCache(llm.target, 2)
    cache, prompt = llm.target.new_cache(), torch.tensor([SHARED])
    features = SequenceFeatures(llm.target.prefill(cache, prompt))
    llm.target.prefill(cache, torch.tensor([[4, 5, 6]]))  # three committed output positions ...
    features.add(llm.target.prefill(llm.target.new_cache(), torch.tensor([[4, 5, 6]])), torch.arange(3))
    pc.store(SHARED + [4], cache, features)  # ... of which the output kept one
    entry, n = pc.match(SHARED + [4, 8])
    assert n == len(SHARED) + 1 and entry.hidden.shape[1] == len(SHARED) + 1


def test_the_cache_keeps_at_most_its_bound_and_frees_evicted_slots(checkpoints):
    llm = _llm(checkpoints, "qwen3_moe", "ar", prefix_cache=2)
    pool_free = lambda: len(llm.target._pool._free)  # noqa: E731
    for i in range(5):
        llm.generate([[i + 1] * 20], GREEDY)  # five distinct prompts
    gc.collect()
    assert len(llm.engine.prefix_cache) == 2
    held = llm.target._pool.num_slots - pool_free()
    assert held == 2  # the two kept prompts' slots; the evicted ones went back to the pool
    llm.engine.prefix_cache.clear()
    gc.collect()
    assert pool_free() == llm.target._pool.num_slots


def test_bad_prefix_cache_settings_are_refused(checkpoints):
    target, _ = checkpoints["qwen3_moe"]
    with pytest.raises(ValueError, match="prefix_cache must be"):
        LLM(str(target), policy="ar", prefix_cache=-1)
    with pytest.raises(ValueError, match="model_impl='lean'"):
        LLM(str(target), policy="ar", prefix_cache=2, model_impl="hf")
    llm = LLM(str(target), policy="ar")
    with pytest.raises(ValueError, match="max_entries"):
        PrefixCache(llm.target, 0)
    a, b = llm.target.new_cache(), llm.target.new_cache()
    with pytest.raises(ValueError, match="holding 0"):
        llm.target.copy_prefix(b, a, 3)
    llm.target.prefill(a, torch.tensor([[1, 2, 3, 4]]))
    llm.target.copy_prefix(b, a, 3)
    assert b.num_tokens == 3
    with pytest.raises(ValueError, match="empty cache"):
        llm.target.copy_prefix(b, a, 2)


def test_a_drafter_started_on_a_kept_prefix_equals_one_prefilled_in_full(checkpoints):
    """Eagle3Source.start with a DrafterPrefix copies the positions the shared prefix determines and
    extends over the rest: the cache equals a full drafter prefill of the new prompt."""
    from trtllm_moespec.engine.prefix_cache import DrafterPrefix

    llm = _llm(checkpoints, "qwen3_moe", "eagle3")
    source, target = llm.engine.draft_source, llm.target
    old, new = torch.tensor([TURNS[0]]), torch.tensor([TURNS[1]])
    kept = source.start(old, target.prefill(target.new_cache(), old), root=3).cache
    full = target.prefill(target.new_cache(), new)
    m = len(TURNS[0])  # the prompts share 33 tokens: drafter positions 0..31 carry over
    alone = source.start(new, full, root=7).cache
    reused = source.start(new, full, root=7, prefix=DrafterPrefix(kept, m - 1)).cache
    assert reused.num_tokens == alone.num_tokens == new.shape[1]
    for a, b in ((reused.keys, alone.keys), (reused.values, alone.values), (reused.last_logits, alone.last_logits)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
