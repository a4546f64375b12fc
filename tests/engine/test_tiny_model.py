"""The shipped moespec-tiny family: every policy is exact against transformers' greedy generate while
its drafts are accepted."""

from __future__ import annotations

import pytest

from tests.engine.conftest import forced_speculation, hf_greedy_references
from trtllm_moespec import LLM, SamplingParams
from trtllm_moespec.assets import tiny_model_paths

PROMPTS = ["def add(a, b):\n    ", "import os\n\nclass Config:\n"]
MAX_TOKENS = 20
# Draft tokens accepted over both prompts (38 tokens after the prefills): about half of those measured
# (eagle3 21, ddd 21, evict 23, ecospec 15, joint 23, coverage 22, oracle 25, ngram drafter 12).
MIN_ACCEPTED = {("eagle3", "eagle3"): 10, ("ddd", "eagle3"): 10, ("evict", "eagle3"): 11, ("ecospec", "eagle3"): 7,
                ("joint", "eagle3"): 11, ("coverage", "eagle3"): 11, ("oracle", "eagle3"): 12, ("eagle3", "ngram"): 6}


@pytest.fixture(scope="module")
def references():
    path = tiny_model_paths()["target"]
    return hf_greedy_references(path, PROMPTS, MAX_TOKENS)


@pytest.mark.parametrize("policy,drafter", [("ar", "eagle3"), ("eagle3", "eagle3"), ("ddd", "eagle3"),
                                            ("evict", "eagle3"), ("ecospec", "eagle3"), ("joint", "eagle3"),
                                            ("coverage", "eagle3"), ("oracle", "eagle3"), ("eagle3", "ngram")])
def test_every_policy_is_exact_and_speculates_on_the_shipped_model(references, policy, drafter):
    """Every policy verifies trees and has draft tokens accepted (cost-aware ones forced to speculate:
    on a CPU their measured costs would decline, and the test would compare plain decoding with itself)."""
    kwargs = {} if policy in ("ar", "eagle3", "oracle") else forced_speculation()
    llm = LLM("moespec-tiny", policy=policy, drafter=drafter, **kwargs)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    for out, ref in zip(outs, references):
        assert out.token_ids == ref
        assert out.text and out.stats.num_tokens == MAX_TOKENS
    accepted = sum(s.accepted_tokens for out in outs for s in out.steps)
    if policy == "ar":
        assert accepted == 0 and all(s.verified_tokens == 0 for out in outs for s in out.steps)
    else:
        assert accepted >= MIN_ACCEPTED[policy, drafter], accepted
        assert all(out.stats.mean_accepted_tokens > 1 for out in outs)


def test_default_llm_uses_the_shipped_drafter_profile_and_head_predictor():
    llm = LLM("moespec-tiny")
    assert llm.policy.name == "joint" and llm.paths.predictor.name == "predictor-head"
    out = llm.generate(["def fibonacci(n):\n"], SamplingParams(max_tokens=32, ignore_eos=True))[0]
    assert out.stats.mean_accepted_tokens > 1.0  # the trained drafter really gets tokens accepted
    assert out.stats.predictor_topk_acc is not None and out.stats.predictor_topk_acc > 0.5
