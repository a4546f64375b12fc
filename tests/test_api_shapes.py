"""The Python API in the shapes vLLM and TensorRT-LLM users write (issue 27, item 3), and the one
resolution step behind `LLM(...)` (issue 28): `RequestOutput.outputs[i]`, `SamplingParams(n=...)`,
a list of SamplingParams per prompt, `chat()` returning a list, `speculative_config=MoESpecConfig(...)`
beside the flat keywords, and `stream()`'s documented event type."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from trtllm_moespec import LLM, CompletionOutput, MoESpecConfig, RequestOutput, SamplingParams, StreamEvent, TreeConfig
from trtllm_moespec.config import SPEC_FIELDS, ResolvedConfig

PROMPTS = ["def fib(n):", "x = [1, 2"]


@pytest.fixture(scope="module")
def ar():
    return LLM("moespec-tiny", policy="ar")


@pytest.fixture(scope="module")
def eagle3(ar):
    return LLM("moespec-tiny", speculative_config=MoESpecConfig(policy="eagle3", tree=TreeConfig(3, 4, 8)),
               target_model=ar.target)


# ------------------------------------------------------------------------------ outputs
def test_outputs_hold_the_completions_and_the_old_attributes_alias_the_first(ar):
    """vLLM code `out.outputs[0].text` works; today's `out.text` etc. are `outputs[0]`'s."""
    out = ar.generate(PROMPTS[0], SamplingParams(max_tokens=6, logprobs=2))[0]
    assert isinstance(out, RequestOutput) and out.finished and out.prompt == PROMPTS[0]
    [first] = out.outputs
    assert isinstance(first, CompletionOutput) and first.index == 0
    assert (out.text, out.token_ids, out.finish_reason, out.stats, out.steps, out.logprobs) == (
        first.text, first.token_ids, first.finish_reason, first.stats, first.steps, first.logprobs)
    assert len(first.token_ids) == 6 and first.finish_reason == "length" and first.text
    assert first.text == ar.tokenizer.decode(first.token_ids, skip_special_tokens=True)
    assert len(first.logprobs) == 6 and first.cumulative_logprob == pytest.approx(sum(e.logprob for e in first.logprobs))
    assert ar.generate([[5, 6, 7]], SamplingParams(max_tokens=2))[0].prompt is None  # token ids: no prompt text
    with pytest.raises(ValueError, match="at least one completion"):
        RequestOutput([1], [])


def test_n_completions_are_the_seeded_requests_of_each(ar):
    """SamplingParams(n=3, seed=s): completion i is what one request with seed s + i gives (vLLM's rule),
    in the same batch; at T=0 the n completions are equal."""
    sampled = SamplingParams(max_tokens=8, temperature=1.0, seed=11, n=3)
    out = ar.generate(PROMPTS[0], sampled)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    alone = ar.generate([PROMPTS[0]] * 3, [dataclasses.replace(sampled, n=1, seed=11 + i) for i in range(3)])
    assert [c.token_ids for c in out.outputs] == [o.token_ids for o in alone]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # the seeds differ, so do the texts
    greedy = ar.generate(PROMPTS, SamplingParams(max_tokens=5, n=2))
    assert [len(o.outputs) for o in greedy] == [2, 2]
    assert all(o.outputs[0].token_ids == o.outputs[1].token_ids for o in greedy)
    one_by_one = ar.generate(PROMPTS, SamplingParams(max_tokens=5, n=2), max_batch_size=1)
    assert [[c.token_ids for c in o.outputs] for o in one_by_one] == [[c.token_ids for c in o.outputs] for o in greedy]
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="^n must be a positive integer"):
            SamplingParams(n=bad)
    with pytest.raises(ValueError, match="seed \\+ n must stay below 2\\*\\*64"):
        SamplingParams(seed=2**64 - 2, n=3)


def test_a_list_of_sampling_params_applies_one_per_prompt(ar):
    """vLLM's `generate(prompts, [sp1, sp2])` (was: AttributeError); (case sampling-params-per-prompt) a list
    of another length, or not SamplingParams, is one clear error."""
    out = ar.generate(PROMPTS, [SamplingParams(max_tokens=3), SamplingParams(max_tokens=7, n=2)])
    assert [len(o.token_ids) for o in out] == [3, 7] and [len(o.outputs) for o in out] == [1, 2]
    assert out[0].token_ids == ar.generate(PROMPTS[0], SamplingParams(max_tokens=3))[0].token_ids
    with pytest.raises(ValueError, match="1 SamplingParams for 2 prompts"):
        ar.generate(PROMPTS, [SamplingParams()])
    with pytest.raises(ValueError, match="sampling_params must be a SamplingParams or a list of them"):
        ar.generate(PROMPTS, {"max_tokens": 3})


def test_chat_returns_a_list(ar):
    """vLLM's `LLM.chat` returns a list, for one conversation too (was: a single object)."""
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    messages = [{"role": "user", "content": "hi"}]
    one = ar.chat(messages, SamplingParams(max_tokens=2), chat_template=template)
    assert isinstance(one, list) and len(one) == 1 and len(one[0].token_ids) == 2
    two = ar.chat([messages, messages], [SamplingParams(max_tokens=2), SamplingParams(max_tokens=3)],
                  chat_template=template)
    assert [len(o.token_ids) for o in two] == [2, 3] and two[0].token_ids == one[0].token_ids


def test_stream_yields_documented_events(ar):
    """`stream()` yields StreamEvent: the new text (`text`, TensorRT-LLM's `text_diff`) and tokens per step,
    the last one `finished` with the RequestOutput; joined texts == the final text. (case stream-n) n > 1
    is refused: a stream is one completion."""
    params = SamplingParams(max_tokens=10)
    events = list(ar.stream(PROMPTS[0], params))
    assert all(isinstance(e, StreamEvent) for e in events)
    assert [e.finished for e in events] == [False] * (len(events) - 1) + [True]
    final = events[-1].output
    assert "".join(e.text_diff for e in events) == final.text == ar.generate(PROMPTS[0], params)[0].text
    assert [t for e in events for t in e.token_ids_diff] == final.token_ids
    assert final.prompt == PROMPTS[0]
    assert "StreamEvent" in (LLM.stream.__doc__ or "") + (StreamEvent.__doc__ or "") and "text" in StreamEvent.__doc__
    with pytest.raises(ValueError, match="stream\\(\\) decodes one completion: n must be 1"):
        next(ar.stream(PROMPTS[0], SamplingParams(n=2)))
    with pytest.raises(ValueError, match="n must be 1"):
        ar.make_request([1, 2], SamplingParams(n=2))


# ------------------------------------------------------------------------------ speculative_config
def test_flat_keywords_are_the_fields_of_moespec_config():
    """Every MoESpecConfig field is an LLM keyword with the same default (the flat form keeps working)."""
    signature = inspect.signature(LLM.__init__).parameters
    for field in dataclasses.fields(MoESpecConfig):
        assert field.name in signature, field.name
        assert signature[field.name].default == field.default, field.name
    assert set(SPEC_FIELDS) == {f.name for f in dataclasses.fields(MoESpecConfig)}
    assert "speculative_config" in signature


def test_speculative_config_resolves_as_the_flat_keywords(ar, eagle3):
    """TensorRT-LLM's shape `LLM(model, speculative_config=...)` and the flat keywords resolve to the same
    configuration and the same greedy output."""
    flat = LLM("moespec-tiny", policy="eagle3", tree=TreeConfig(3, 4, 8), target_model=ar.target)
    assert isinstance(eagle3.config, ResolvedConfig)
    assert eagle3.config.spec == flat.config.spec == eagle3.speculative_config
    assert (eagle3.config.guard, eagle3.config.drafter, eagle3.config.draft_stop) == ("off", "eagle3", False)
    assert (eagle3.policy_name, eagle3.tree, eagle3.values_name) == ("eagle3", TreeConfig(3, 4, 8), "calibrated")
    params = SamplingParams(max_tokens=12)
    reference = ar.generate(PROMPTS, params)
    assert [o.token_ids for o in eagle3.generate(PROMPTS, params)] == [o.token_ids for o in reference]
    assert [o.token_ids for o in flat.generate(PROMPTS, params)] == [o.token_ids for o in reference]
    with pytest.raises(dataclasses.FrozenInstanceError):
        eagle3.config.guard = "measured"


def test_speculative_config_and_a_flat_keyword_together_are_refused():
    """(case speculative-config-twice) A flat keyword away from its default beside speculative_config would be
    silently ignored: refused, before anything loads."""
    with pytest.raises(ValueError, match="^policy, guard given both as keyword"):
        LLM("moespec-tiny", policy="ar", guard="off", speculative_config=MoESpecConfig(policy="eagle3"))
    with pytest.raises(ValueError, match="speculative_config must be a MoESpecConfig, got dict"):
        LLM("moespec-tiny", speculative_config={"policy": "ar"})
    for bad, message in (({"policy": "fastest"}, "unknown policy"), ({"guard": "maybe"}, "guard must be one of"),
                         ({"tree": (4, 8, 32)}, "tree must be a TreeConfig"), ({"draft_model": 3}, "draft_model must be"),
                         ({"override_profile": "yes"}, "override_profile must be True or False")):
        with pytest.raises(ValueError, match=message):
            MoESpecConfig(**bad)
    options = {"budget": 4}
    config = MoESpecConfig(policy="eagle3", policy_options=options)
    options["budget"] = 99
    assert config.policy_options == {"budget": 4}  # a copy: the frozen config does not change under its caller


def test_empty_allowed_token_ids_are_refused():
    """(case allowed-token-ids-empty) `allowed_token_ids=[]` would allow no token; it meant "no restriction".
    Refused, as vLLM refuses it; None still allows every token."""
    for empty in ([], (), set()):
        with pytest.raises(ValueError, match="^allowed_token_ids is empty: no token could be drawn"):
            SamplingParams(allowed_token_ids=empty)
    for bad in (5, "ab", [1, -1]):
        with pytest.raises(ValueError, match="^allowed_token_ids must be a list of token ids"):
            SamplingParams(allowed_token_ids=bad)
    assert SamplingParams(allowed_token_ids=None).logit_rules().allowed == ()
    assert SamplingParams(allowed_token_ids=[7, 3, 7]).allowed_token_ids == (3, 7)
