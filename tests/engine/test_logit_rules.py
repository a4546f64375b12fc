"""Logit rules stay lossless: greedy output with repetition / presence / frequency penalties, a logit
bias, min_tokens and stop_token_ids equals transformers' generate (repetition) and a plain reference
loop over transformers' forward (the others), under every kind of policy, alone and batched, on
both architectures; and sampled tokens follow the processed target distribution (penalties, min_p)."""

from __future__ import annotations

import pytest
import torch
import transformers

from tests.engine.distribution import assert_follows, draw, exact_first_tokens
from trtllm_moespec import LLM, SamplingParams, TreeConfig
from trtllm_moespec.engine.batch import BatchedEngine

TINY_TARGET = "trtllm_moespec/assets/moespec-tiny/target"
PROMPT = "def add(a, b):\n"
MAX_TOKENS = 24


def penalize(logits: torch.Tensor, prompt: list[int], output: list[int], presence: float = 0.0,
             frequency: float = 0.0, repetition: float = 1.0) -> torch.Tensor:
    """The reference rule, token by token: vLLM's order, repetition over prompt and output, presence
    and frequency over the output."""
    logits = logits.clone().double()
    for t in set(prompt) | set(output):
        logits[t] = logits[t] / repetition if logits[t] > 0 else logits[t] * repetition
    for t in set(output):
        logits[t] -= frequency * output.count(t) + presence
    return logits


@torch.no_grad()
def reference_greedy(target_dir, prompt: list[int], n: int, bias: dict[int, float] | None = None,
                     stop: tuple[int, ...] = (), min_tokens: int = 0, allowed: tuple[int, ...] = (),
                     bad: tuple[tuple[int, ...], ...] = (), **penalties) -> list[int]:
    """Plain greedy decoding with transformers' forward over the whole context each step: stop tokens
    masked before min_tokens, tokens outside `allowed` masked, then the bias, then the penalties; the
    output ends at a stop token."""
    kwargs = {"attn_implementation": "eager"} if "gpt_oss" in str(target_dir) else {}
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32, **kwargs)
    out: list[int] = []
    while len(out) < n and not (out and out[-1] in stop):
        logits = hf(torch.tensor([prompt + out])).logits[0, -1].clone()
        if len(out) < min_tokens:
            logits[list(stop)] = -torch.inf
        if allowed:
            logits[[t for t in range(logits.numel()) if t not in allowed]] = -torch.inf
        context = prompt + out
        for word in bad:  # its last token, where the context ends with the rest of it
            if len(word) == 1 or context[-(len(word) - 1):] == list(word[:-1]):
                logits[word[-1]] = -torch.inf
        for t, b in (bias or {}).items():
            logits[t] += b
        out.append(int(penalize(logits, prompt, out, **penalties).argmax()))
    return out


@pytest.fixture(scope="module")
def tiny():
    return {policy: LLM("moespec-tiny", policy=policy) for policy in ("ar", "eagle3", "joint")}


# Sampling tests: the prefill's token, then one speculative step with a depth-1 tree (the engine cuts
# trees to max_tokens - 2), whose two root children leave a residual when rejected.
SAMPLED_TOKENS = 3


@pytest.fixture(scope="module")
def sampling_llm():
    return LLM("moespec-tiny", policy="eagle3", tree=TreeConfig(steps=3, topk=2, max_draft_tokens=6))


@pytest.mark.parametrize("policy", ["ar", "eagle3", "joint"])
def test_repetition_penalty_equals_transformers_generate(tiny, policy):
    llm = tiny[policy]
    ids = llm.encode([PROMPT])[0]
    hf = transformers.AutoModelForCausalLM.from_pretrained(TINY_TARGET, dtype=torch.float32)
    want = hf.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False, repetition_penalty=1.3,
                       eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
    plain = llm.generate([ids], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))[0]
    out = llm.generate([ids], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, repetition_penalty=1.3))[0]
    assert out.token_ids == want and want != plain.token_ids  # the penalty changed the text, losslessly
    if policy == "eagle3":  # trees were verified and nodes accepted under the penalized distributions
        assert max(s.accepted_tokens for s in out.steps) >= 2


@pytest.mark.parametrize("policy", ["ar", "eagle3"])
def test_presence_and_frequency_penalties_equal_the_reference_loop(tiny, policy):
    llm = tiny[policy]
    ids = llm.encode([PROMPT])[0]
    penalties = dict(presence=0.4, frequency=0.7)
    want = reference_greedy(TINY_TARGET, ids, MAX_TOKENS, **penalties)
    out = llm.generate([ids], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, presence_penalty=0.4,
                                             frequency_penalty=0.7))[0]
    assert out.token_ids == want
    if policy == "eagle3":
        assert max(s.accepted_tokens for s in out.steps) >= 2


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_all_penalties_batched_equal_the_reference_loop(checkpoints, arch):
    """A batch mixing requests with and without penalties (GPT-OSS: past its sliding window), and the
    plain batch step (policy ar) that verifies roots of both kinds together."""
    target, draft = checkpoints[arch]
    prompts = [[5, 17, 33, 2, 9, 100, 4], [1, 2, 3, 1, 2, 3, 1, 2], [7, 7, 8]]
    penalties = dict(presence=-0.5, frequency=1.5, repetition=1.4)
    want = [reference_greedy(target, p, 20, **penalties) for p in prompts[:2]] + [reference_greedy(target, prompts[2], 20)]
    params = SamplingParams(max_tokens=20, ignore_eos=True, presence_penalty=-0.5, frequency_penalty=1.5,
                            repetition_penalty=1.4)
    for policy in ("eagle3", "ar"):
        llm = LLM(str(target), draft_model=str(draft), policy=policy)
        requests = [llm.make_request(p, params) for p in prompts[:2]]
        requests.append(llm.make_request(prompts[2], SamplingParams(max_tokens=20, ignore_eos=True)))
        BatchedEngine(llm.engine, max_batch_size=3).run_all(requests)
        assert [r.output_ids for r in requests] == want, policy


def test_allowed_token_ids_batched_equal_the_reference_loop(checkpoints):
    """A batch mixing a request restricted to every third token with a free one, speculative and plain."""
    target, draft = checkpoints["qwen3_moe"]
    prompts = [[5, 17, 33, 2, 9, 100, 4], [7, 7, 8]]
    allowed = tuple(range(0, 128, 3))
    want = [reference_greedy(target, prompts[0], 16, allowed=allowed), reference_greedy(target, prompts[1], 16)]
    for policy in ("eagle3", "ar"):
        llm = LLM(str(target), draft_model=str(draft), policy=policy)
        requests = [llm.make_request(prompts[0], SamplingParams(max_tokens=16, ignore_eos=True, allowed_token_ids=allowed)),
                    llm.make_request(prompts[1], SamplingParams(max_tokens=16, ignore_eos=True))]
        BatchedEngine(llm.engine, max_batch_size=2).run_all(requests)
        assert [r.output_ids for r in requests] == want, policy


def test_sampled_tokens_follow_the_penalized_distribution(sampling_llm):
    """The first three sampled tokens (the later ones under the penalties of the earlier) against the exact
    penalized top-k law, through a speculating engine that accepts drafts (seeded chi-square,
    deterministic; batches of 16 requests)."""
    llm, top_k = sampling_llm, 3
    prompt = llm.encode([PROMPT])[0]
    exact = exact_first_tokens(TINY_TARGET, prompt, SAMPLED_TOKENS, top_k=top_k,
                               adjust=lambda logits, output: penalize(logits, prompt, output, 0.5, 1.0, 1.5))
    draws = draw(llm, prompt, lambda seed: SamplingParams(
        max_tokens=SAMPLED_TOKENS, temperature=1.0, top_k=top_k, seed=seed, ignore_eos=True, presence_penalty=0.5,
        frequency_penalty=1.0, repetition_penalty=1.5), 400, batch_size=16)
    assert draws.accepted >= 100, draws.accepted  # measured: 197 of 400
    assert_follows(draws, exact)


@pytest.mark.parametrize("policy", ["ar", "eagle3"])
def test_logit_bias_equals_the_reference_loop(tiny, policy):
    llm = tiny[policy]
    ids = llm.encode([PROMPT])[0]
    plain = llm.generate([ids], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))[0].token_ids
    bias = {plain[1]: -100.0, plain[4]: 3.5}  # the second token banned, another favoured
    want = reference_greedy(TINY_TARGET, ids, MAX_TOKENS, bias=bias)
    out = llm.generate([ids], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, logit_bias=bias))[0]
    assert out.token_ids == want and want != plain and plain[1] not in want
    if policy == "eagle3":
        assert max(s.accepted_tokens for s in out.steps) >= 2


@pytest.mark.parametrize("policy", ["ar", "eagle3", "joint"])
def test_allowed_token_ids_equal_the_reference_loop(tiny, policy):
    """vLLM's allowed_token_ids: greedy output equals decoding with every other token masked, under every
    policy (the drafter proposes from the allowed tokens too, so trees are still accepted)."""
    llm = tiny[policy]
    ids = llm.encode([PROMPT])[0]
    plain = llm.generate([ids], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))[0].token_ids
    allowed = tuple(sorted(set(plain) - {plain[2]}) + [5, 17, 300])  # the text's tokens but one, and a few others
    want = reference_greedy(TINY_TARGET, ids, MAX_TOKENS, allowed=allowed)
    out = llm.generate([ids], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, allowed_token_ids=allowed))[0]
    assert out.token_ids == want and want != plain and set(want) <= set(allowed)
    if policy == "eagle3":
        assert max(s.accepted_tokens for s in out.steps) >= 2
    from trtllm_moespec import StructuredOutput
    with pytest.raises(ValueError, match="allowed_token_ids cannot be combined with structured output"):
        SamplingParams(allowed_token_ids=allowed, structured=StructuredOutput.of(json_object=True))


@pytest.mark.parametrize("policy", ["ar", "eagle3"])
def test_bad_words_equal_the_reference_loop(tiny, policy):
    """vLLM's bad_words: each word (tokenized alone and after a space) is never completed; greedy output
    equals decoding that bans a word's last token wherever the context ends with the rest of it, also
    inside speculated trees (each position under its own path)."""
    llm = tiny[policy]
    ids = llm.encode([PROMPT])[0]
    plain = llm.generate([ids], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))[0]
    words = [llm.tokenizer.decode(plain.token_ids[3:5]), llm.tokenizer.decode(plain.token_ids[8:9])]
    bad = llm.bad_word_ids(words)
    assert any(len(w) >= 2 for w in bad)  # a multi-token word: its prefix is read from the context
    want = reference_greedy(TINY_TARGET, ids, MAX_TOKENS, bad=bad)
    out = llm.generate([ids], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, bad_words=words))[0]
    assert out.token_ids == want and want != plain.token_ids
    for word in bad:  # no bad word's tokens appear in a row
        assert not any(want[i:i + len(word)] == list(word) for i in range(len(want)))
    if policy == "eagle3":
        assert max(s.accepted_tokens for s in out.steps) >= 2


def test_the_drafter_proposes_under_the_same_rules(tiny, monkeypatch):
    """A token the logit bias bans is never drafted with nonzero probability (it was, without the
    rules applied to the drafter), the output is the same either way, and acceptance does not fall."""
    import trtllm_moespec.engine.engine as engine_module
    from trtllm_moespec.models.eagle3 import drafting as eagle3_draft

    llm = tiny["eagle3"]
    ids = llm.encode([PROMPT])[0]
    plain = llm.generate([ids], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))[0].token_ids
    banned = plain[1]  # the first tree (after the prefill's token) drafts it first
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, logit_bias={banned: -100.0}, repetition_penalty=1.1)
    drafted = []
    draft = eagle3_draft.draft_eagle3_trees

    def recording(*args, **kwargs):
        outs = draft(*args, **kwargs)
        tree = outs[0].tree
        drafted.extend(s for t, s in zip(tree.token_ids[0].tolist(), tree.log_scores[0].exp().tolist()) if t == banned)
        return outs

    monkeypatch.setattr(eagle3_draft, "draft_eagle3_trees", recording)
    guided = llm.generate([ids], params)[0]
    assert max(drafted, default=0.0) < 1e-12  # never proposed, or only as a zero-probability top-k filler
    drafted.clear()
    monkeypatch.setattr(engine_module, "draft_constraint", lambda request: None)
    free = llm.generate([ids], params)[0]
    assert max(drafted) > 0.01 and guided.token_ids == free.token_ids and banned not in guided.token_ids
    assert guided.stats.mean_accepted_tokens >= free.stats.mean_accepted_tokens


@pytest.mark.parametrize("policy", ["ar", "eagle3", "joint"])
def test_stop_token_ids_and_min_tokens_equal_the_reference_loop(tiny, policy):
    """A stop token ends the output (kept, finish "stop"); with min_tokens it cannot be drawn before
    the output holds that many tokens, also at the deeper nodes of a tree."""
    llm = tiny[policy]
    ids = llm.encode([PROMPT])[0]
    plain = llm.generate([ids], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))[0].token_ids
    stop = (plain[3],)
    early = llm.generate([ids], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, stop_token_ids=stop))[0]
    assert early.token_ids == plain[:plain.index(stop[0]) + 1] and early.finish_reason == "stop"
    want = reference_greedy(TINY_TARGET, ids, MAX_TOKENS, stop=stop, min_tokens=10)
    out = llm.generate([ids], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, stop_token_ids=stop,
                                             min_tokens=10))[0]
    assert out.token_ids == want and stop[0] not in want[:10]


def test_min_p_greedy_is_unchanged_and_sampling_follows_the_filtered_distribution(tiny, sampling_llm):
    """moespec-tiny (peaked distributions, its drafter accepted), so min_p filters and trees are walked."""
    top_k, min_p = 4, 0.2
    llm = tiny["eagle3"]
    prompt = llm.encode([PROMPT])[0]
    greedy = SamplingParams(max_tokens=8, ignore_eos=True)
    assert llm.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True, min_p=0.9))[0].token_ids == \
        llm.generate([prompt], greedy)[0].token_ids
    exact = exact_first_tokens(TINY_TARGET, prompt, SAMPLED_TOKENS, top_k=top_k, min_p=min_p)
    assert len(exact) < len(exact_first_tokens(TINY_TARGET, prompt, SAMPLED_TOKENS, top_k=top_k))  # min_p filtered
    draws = draw(sampling_llm, prompt, lambda seed: SamplingParams(
        max_tokens=SAMPLED_TOKENS, temperature=1.0, top_k=top_k, min_p=min_p, seed=seed, ignore_eos=True), 400,
        batch_size=16)
    assert draws.accepted >= 140, draws.accepted  # measured: 289 of 400
    assert_follows(draws, exact)


@pytest.mark.parametrize("bad", [dict(presence_penalty=2.5), dict(frequency_penalty=-3), dict(repetition_penalty=0),
                                 dict(repetition_penalty=float("inf")), dict(presence_penalty=True),
                                 dict(logit_bias={3: 101}), dict(logit_bias={-1: 1.0}), dict(logit_bias={"3": 1.0}),
                                 dict(min_tokens=-1), dict(min_tokens=1.5), dict(stop_token_ids=[-2]),
                                 dict(min_p=1.5), dict(min_p=-0.1), dict(allowed_token_ids=[-1]),
                                 dict(allowed_token_ids="ab")])
def test_bad_logit_rules_are_refused(bad):
    """(case logit-rules-out-of-range)"""
    with pytest.raises(ValueError, match=next(iter(bad))):
        SamplingParams(**bad)


def test_a_logit_bias_outside_the_vocabulary_is_refused_before_generating(tiny):
    """(case logit-bias-outside-vocab)"""
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tiny["ar"].generate([PROMPT], SamplingParams(logit_bias={10**6: 1.0}))
    with pytest.raises(ValueError, match="allowed_token_ids names a token id outside the vocabulary"):
        tiny["ar"].generate([PROMPT], SamplingParams(allowed_token_ids=[3, 10**6]))
    eos = tiny["ar"].target.eos_token_ids[0]
    with pytest.raises(ValueError, match="only stop tokens, which min_tokens bans"):
        tiny["ar"].generate([PROMPT], SamplingParams(allowed_token_ids=[eos], min_tokens=2))
