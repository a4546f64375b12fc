"""Logprobs of the output tokens: the target's raw log-softmax at each token's position, as
transformers' forward over prompt + output gives it, under every policy, sampled or greedy, alone
or batched, and still aligned with the tokens after eos and max_tokens cut a step's tokens; and
those of the prompt's tokens, alone, batched and beside a prefix cache."""

from __future__ import annotations

import pytest
import torch
import transformers

from trtllm_moespec import LLM, SamplingParams
from trtllm_moespec.engine.batch import BatchedEngine

TINY_TARGET = "trtllm_moespec/assets/moespec-tiny/target"
PROMPT = "def add(a, b):\n"
ATOL = 1e-4


def _reference(target_dir: str, prompt_ids: list[int], output_ids: list[int], **kwargs) -> torch.Tensor:
    """[len(output), V] transformers' log-softmax at the position each output token was drawn from."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32, **kwargs)
    with torch.no_grad():
        logits = hf(torch.tensor([prompt_ids + output_ids])).logits[0].float()
    P = len(prompt_ids)
    return torch.log_softmax(logits[P - 1:P - 1 + len(output_ids)], dim=-1)


def _check(out, ref: torch.Tensor, top_n: int) -> None:
    assert [e.token_id for e in out.logprobs] == out.token_ids
    chosen = ref.gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor([e.logprob for e in out.logprobs]), chosen, atol=ATOL, rtol=0)
    values, ids = ref.topk(top_n, dim=-1)
    for e, v, i in zip(out.logprobs, values, ids):
        assert [t for t, _ in e.top] == i.tolist()
        torch.testing.assert_close(torch.tensor([lp for _, lp in e.top]), v, atol=ATOL, rtol=0)
    # rank: 1 + the tokens more likely than the chosen one (a greedy token's is 1)
    assert [e.rank for e in out.logprobs] == ((ref > chosen[:, None] + ATOL).sum(-1) + 1).tolist()


@pytest.fixture(scope="module")
def tiny():
    return {policy: LLM("moespec-tiny", policy=policy) for policy in ("ar", "eagle3", "joint")}


@pytest.mark.parametrize("policy", ["ar", "eagle3", "joint"])
def test_greedy_logprobs_equal_transformers_forward(tiny, policy):
    """moespec-tiny's drafter is accepted several tokens a step, so the emitted tokens' positions in
    the verified tree (not just the root) are exercised."""
    out = tiny[policy].generate([PROMPT], SamplingParams(max_tokens=24, ignore_eos=True, logprobs=3))[0]
    _check(out, _reference(TINY_TARGET, out.prompt_token_ids, out.token_ids), 3)
    if policy == "eagle3":
        assert max(s.accepted_tokens for s in out.steps) >= 2


def test_sampled_logprobs_are_the_raw_distribution(tiny):
    """At temperature 0.8 with top-k the tokens are sampled from the processed distribution, but the
    reported logprobs are the model's own (vLLM's raw_logprobs)."""
    params = SamplingParams(max_tokens=20, temperature=0.8, top_k=20, seed=5, ignore_eos=True, logprobs=0)
    out = tiny["eagle3"].generate([PROMPT], params)[0]
    _check(out, _reference(TINY_TARGET, out.prompt_token_ids, out.token_ids), 0)
    assert all(e.top == () for e in out.logprobs)


def test_logprobs_stay_aligned_when_eos_and_max_tokens_cut_a_step(tiny):
    llm = tiny["eagle3"]
    full = llm.generate([PROMPT], SamplingParams(max_tokens=24, ignore_eos=True, logprobs=1))[0]

    def same(logprobs, n: int) -> None:  # trees cut at the end differ: equal up to the rounding of other forwards
        assert [e.token_id for e in logprobs] == full.token_ids[:n]
        assert [e.logprob for e in logprobs] == pytest.approx([e.logprob for e in full.logprobs[:n]], abs=ATOL)

    for max_tokens in (7, 10, 13):  # eagle3 commits several tokens a step: some of these cut a step short
        out = llm.generate([PROMPT], SamplingParams(max_tokens=max_tokens, ignore_eos=True, logprobs=1))[0]
        assert out.token_ids == full.token_ids[:max_tokens]
        same(out.logprobs, max_tokens)
    stop = full.token_ids[9]  # an "eos" inside a step: the output and its logprobs end at it
    request = llm.make_request(full.prompt_token_ids, SamplingParams(max_tokens=24, ignore_eos=True, logprobs=1))
    request.stop_ids = frozenset([stop])
    for _ in llm.engine.run(request):
        pass
    n = full.token_ids.index(stop) + 1
    assert request.output_ids == full.token_ids[:n] and request.finish_reason == "stop"
    same(request.output_logprobs, n)


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_batched_logprobs_equal_transformers_forward(checkpoints, arch):
    """Requests batched in one target forward (GPT-OSS: sinks, a sliding window the output crosses)."""
    target, draft = checkpoints[arch]
    llm = LLM(str(target), draft_model=str(draft), policy="eagle3")
    prompts = [[5, 17, 33, 2, 9, 100, 4], [1, 2, 3, 1, 2, 3, 1, 2], [7, 7, 8]]
    params = SamplingParams(max_tokens=20, ignore_eos=True, logprobs=2)
    requests = [llm.make_request(p, params) for p in prompts]
    BatchedEngine(llm.engine, max_batch_size=3).run_all(requests)
    kwargs = {"attn_implementation": "eager"} if arch == "gpt_oss" else {}
    for r in requests:
        ref = _reference(target, r.prompt_ids, r.output_ids, **kwargs)
        chosen = ref.gather(1, torch.tensor(r.output_ids)[:, None])[:, 0]
        assert [e.token_id for e in r.output_logprobs] == r.output_ids
        torch.testing.assert_close(torch.tensor([e.logprob for e in r.output_logprobs]), chosen, atol=ATOL, rtol=0)


def _check_prompt(logprobs, prompt_ids: list[int], ref: torch.Tensor, top_n: int) -> None:
    """logprobs (None, then prompt tokens 1..) against ref [L, V]: the log-softmax at every prompt position."""
    assert logprobs[0] is None and [e.token_id for e in logprobs[1:]] == prompt_ids[1:]
    chosen = ref[:-1].gather(1, torch.tensor(prompt_ids[1:])[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor([e.logprob for e in logprobs[1:]]), chosen, atol=ATOL, rtol=0)
    assert [[t for t, _ in e.top] for e in logprobs[1:]] == ref[:-1].topk(top_n, dim=-1).indices.tolist()


@pytest.mark.parametrize("policy", ["ar", "eagle3"])
def test_prompt_logprobs_equal_transformers_forward_and_change_no_output(tiny, policy, monkeypatch):
    """Every prompt token's logprob under its context (in blocks smaller than the prompt), and the
    output of the same request without them."""
    import trtllm_moespec.core.logprobs as core

    monkeypatch.setattr(core, "PROMPT_LOGPROBS_CHUNK", 3)
    llm = tiny[policy]
    plain = llm.generate([PROMPT], SamplingParams(max_tokens=12, ignore_eos=True))[0]
    out = llm.generate([PROMPT], SamplingParams(max_tokens=12, ignore_eos=True, prompt_logprobs=2))[0]
    assert out.token_ids == plain.token_ids and out.logprobs is None and plain.prompt_logprobs is None
    assert len(out.prompt_logprobs) == len(out.prompt_token_ids) > 3
    _check_prompt(out.prompt_logprobs, out.prompt_token_ids, _prompt_reference(out.prompt_token_ids), 2)


def _prompt_reference(prompt_ids: list[int]) -> torch.Tensor:
    hf = transformers.AutoModelForCausalLM.from_pretrained(TINY_TARGET, dtype=torch.float32)
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([prompt_ids])).logits[0].float(), dim=-1)


def test_prompt_logprobs_in_a_batch_beside_a_prefix_cache():
    """A batch admitted together: the request asking for prompt logprobs is prefilled alone (and
    reuses no cached prefix, whose positions kept no logits); every output is the one alone."""
    llm = LLM("moespec-tiny", policy="eagle3", prefix_cache=4)
    ids = llm.encode([PROMPT * 6])[0]  # long enough to be cached
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    want = llm.generate([ids, ids[:-2]], params)  # also fills the prefix cache
    requests = [llm.make_request(ids, SamplingParams(max_tokens=8, ignore_eos=True, prompt_logprobs=1)),
                llm.make_request(ids[:-2], params)]
    hits = llm.engine.prefix_cache.hits
    BatchedEngine(llm.engine, max_batch_size=2).run_all(requests)
    assert [r.output_ids for r in requests] == [w.token_ids for w in want]
    assert llm.engine.prefix_cache.hits == hits + 1  # the second request reused its prefix, the first did not
    _check_prompt([None, *requests[0].prompt_token_logprobs], ids, _prompt_reference(ids), 1)
    assert requests[1].prompt_token_logprobs == []


@pytest.mark.parametrize("name", ["logprobs", "prompt_logprobs"])
@pytest.mark.parametrize("bad", [-1, 21, True, 1.5])
def test_bad_logprobs_are_refused(name, bad):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**{name: bad})


def test_streamed_events_carry_their_tokens_logprobs(tiny):
    """LLM.stream: each event's logprobs are those of its tokens, and joined they are the output's,
    also when a stop string cuts the last step."""
    llm = tiny["eagle3"]
    text = llm.generate([PROMPT], SamplingParams(max_tokens=24, ignore_eos=True))[0].text
    params = SamplingParams(max_tokens=24, ignore_eos=True, logprobs=1, stop=[text[10:13]])
    events = list(llm.stream(PROMPT, params))
    out = events[-1].output
    assert out.finish_reason == "stop" and len(events) > 2
    assert all([e.token_id for e in ev.logprobs] == ev.token_ids for ev in events)
    assert [e for ev in events for e in ev.logprobs] == list(out.logprobs)
