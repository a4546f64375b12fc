"""Seeded requests on the shipped moespec-tiny: the text is a function of the seed alone. Every policy
(drafts accepted), alone and in batches of other requests, and whatever the goodput guard decides,
gives the text plain decoding (`ar`) gives with that seed; the same seed twice gives the same text,
and different seeds differ (core/seeded.py, the position-keyed rule of core/verify.py)."""

from __future__ import annotations

import random

import pytest

from tests.engine.conftest import TINY_TARGET, forced_speculation
from tests.engine.distribution import assert_follows, draw, exact_first_tokens
from tests.engine.test_logit_rules import penalize
from trtllm_moespec import LLM, SamplingParams, TreeConfig
from trtllm_moespec.engine.batch_cost import GoodputGuard
from trtllm_moespec.engine.guard import GuardState

PROMPTS = ["def add(a, b):\n    ", "import os\n\nclass Config:\n"]
MAX_TOKENS = 16
SEED = 5


def _params(seed: int | None = SEED, temperature: float = 1.0) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=temperature, seed=seed, ignore_eos=True)


def _accepted(outs) -> int:
    return sum(s.accepted_tokens for out in outs for s in out.steps)


@pytest.fixture(scope="module")
def plain():
    """ar's text of each prompt with SEED, decoded alone."""
    llm = LLM("moespec-tiny", policy="ar")
    return [out.token_ids for out in llm.generate(PROMPTS, _params(), max_batch_size=1)]


@pytest.mark.parametrize("policy", ["ar", "eagle3", "evict", "ecospec", "joint"])
def test_every_policy_alone_and_batched_gives_the_text_ar_gives(plain, policy):
    """Cost-aware policies are forced to speculate (on a CPU their costs would decline, and the test
    would compare plain decoding with itself). The batch holds, beside the two seeded requests, a
    greedy one and another seed, with three slots for four requests (one joins mid-way)."""
    kwargs = {} if policy in ("ar", "eagle3") else forced_speculation()
    llm = LLM("moespec-tiny", policy=policy, **kwargs)
    alone = llm.generate(PROMPTS, _params(), max_batch_size=1)
    batched = llm.generate(PROMPTS + PROMPTS, [_params(), _params(), _params(temperature=0.0), _params(seed=SEED + 1)],
                           max_batch_size=3)
    assert [out.token_ids for out in alone] == plain
    assert [out.token_ids for out in batched[:2]] == plain
    assert all(len(ids) == MAX_TOKENS for ids in plain)
    if policy != "ar":
        assert _accepted(alone) > 0 and _accepted(batched[:2]) > 0, (_accepted(alone), _accepted(batched[:2]))


def test_whatever_the_guard_decides_the_text_is_ar_s(plain, monkeypatch):
    """The default joint policy with its guard on, its speculate-or-not decisions replaced by coin flips
    (the guard's state changes them from call to call): the same text as ar, alone and batched, on
    three calls, with both kinds of step taken and drafts accepted."""
    coin = random.Random(0)
    monkeypatch.setattr(GuardState, "speculate", lambda self: coin.random() < 0.5)
    monkeypatch.setattr(GoodputGuard, "speculate", lambda self, batch_size, greedy=False: coin.random() < 0.5)
    llm = LLM("moespec-tiny")
    assert llm.engine.guard is not None
    runs = [llm.generate(PROMPTS, _params(), max_batch_size=size) for size in (1, 2, 1)]
    for outs in runs:
        assert [out.token_ids for out in outs] == plain
    steps = [s for outs in runs for out in outs for s in out.steps]
    assert any(s.speculated for s in steps) and not all(s.speculated for s in steps)
    assert sum(s.accepted_tokens for s in steps) > 0


def test_same_seed_same_text_and_different_seeds_differ():
    """Under the default joint policy and its real guard, whose state carries over between calls."""
    llm = LLM("moespec-tiny")
    first = [llm.generate([PROMPTS[0]], _params(seed=seed))[0].token_ids for seed in (SEED, SEED + 1, SEED + 2)]
    again = [llm.generate([PROMPTS[0]], _params(seed=seed))[0].token_ids for seed in (SEED, SEED + 1, SEED + 2)]
    assert first == again
    assert len({tuple(ids) for ids in first}) == 3


def test_seeded_tokens_follow_the_penalized_law_at_each_node():
    """The position-keyed rule samples each node from its own processed distribution: the first three
    tokens (each penalized by the earlier ones, also inside the tree) against the exact penalized top-k
    law of tests/engine/distribution.py, seeds 0..399 in batches of 16, drafts accepted at depth 1."""
    llm = LLM("moespec-tiny", policy="eagle3", tree=TreeConfig(steps=3, topk=2, max_draft_tokens=6))
    prompt = llm.encode([PROMPTS[0]])[0]
    exact = exact_first_tokens(TINY_TARGET, prompt, 3, top_k=3,
                               adjust=lambda logits, output: penalize(logits, prompt, output, 0.5, 1.0, 1.5))
    draws = draw(llm, prompt, lambda seed: SamplingParams(
        max_tokens=3, temperature=1.0, top_k=3, seed=seed, ignore_eos=True, presence_penalty=0.5,
        frequency_penalty=1.0, repetition_penalty=1.5), 400, batch_size=16, seeded=True)
    assert draws.accepted >= 86, draws.accepted  # half of those measured (172 of 400)
    assert_follows(draws, exact)
