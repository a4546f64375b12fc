"""Invariant 1: greedy output of every policy and both drafters equals transformers' greedy generate,
with draft tokens accepted (cost-aware policies forced to speculate on these random drafters)."""

from __future__ import annotations

import pytest
import torch
import transformers

from tests.engine.conftest import expert_term_off, forced_speculation
from trtllm_moespec import LLM, SamplingParams

POLICIES = ["ar", "eagle3", "ddd", "evict", "ecospec", "joint", "coverage", "oracle"]
PROMPTS = [[5, 17, 33, 2, 9, 100, 4], [1, 2, 3, 1, 2, 3, 1, 2]]
MAX_TOKENS = 24  # > 2 * the GPT-OSS test window (8): generation crosses it
COST_AWARE = ("ddd", "evict", "ecospec", "joint", "coverage")  # they decline to speculate unless forced


@pytest.fixture(scope="module")
def references(checkpoints):
    refs = {}
    for name, (target, _) in checkpoints.items():
        kwargs = {"attn_implementation": "eager"} if name == "gpt_oss" else {}
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(target), **kwargs)
        for i, prompt in enumerate(PROMPTS):
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None,
                              pad_token_id=0)
            refs[name, i] = out[0, len(prompt):].tolist()
    return refs


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
@pytest.mark.parametrize("drafter", ["eagle3", "ngram"])
@pytest.mark.parametrize("policy", POLICIES)
def test_greedy_equals_transformers_generate(checkpoints, references, arch, drafter, policy):
    if policy == "ar" and drafter == "ngram":
        pytest.skip("ar does not draft")
    _check_greedy(checkpoints, references, arch, drafter, policy, "lean")


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
@pytest.mark.parametrize("policy", ["ar", "eagle3", "joint"])
def test_greedy_with_transformers_forward_equals_generate(checkpoints, references, arch, policy):
    """model_impl="hf" (transformers' own forward, the reference implementation) stays exact too."""
    _check_greedy(checkpoints, references, arch, "eagle3", policy, "hf")


def _check_greedy(checkpoints, references, arch, drafter, policy, model_impl):
    target, draft = checkpoints[arch]
    predictor = "oracle" if policy in ("ecospec", "joint") else None
    llm = LLM(str(target), draft_model=str(draft), policy=policy, drafter=drafter, predictor=predictor,
              model_impl=model_impl, **_speculating(policy, arch))
    assert llm.target.model_impl == model_impl
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    for i, out in enumerate(outs):
        assert out.token_ids == references[arch, i], f"{policy}/{drafter} diverged on prompt {i}"
        assert out.finish_reason == "length"
        stats = out.stats
        assert stats.num_tokens == MAX_TOKENS
        assert sum(stats.acceptance_lengths) == MAX_TOKENS - 1  # the first token comes from the prefill
        if policy == "ar":
            assert stats.verified_tokens == 0
    _assert_speculated(outs, policy)


def _speculating(policy: str, arch: str) -> dict:
    """Cost-aware policies forced to speculate: on the random test drafters their costs never pay, and
    ecospec's paper budget of 3 nodes rarely holds the target's token."""
    if policy not in COST_AWARE:
        return {}
    return {**forced_speculation(model_id=arch), **({"policy_options": {"budget": 32}} if policy == "ecospec" else {})}


def _assert_speculated(outs, policy: str) -> None:
    """Draft tokens were accepted: the test compared speculative decoding, not plain decoding, with the reference."""
    accepted = sum(s.accepted_tokens for out in outs for s in out.steps)
    if policy == "ar":
        assert accepted == 0
    else:
        assert accepted > 0, f"{policy} accepted no draft token"
        assert max(out.stats.mean_accepted_tokens for out in outs) > 1


@pytest.mark.parametrize("values", ["raw", "calibrated", "head"])
@pytest.mark.parametrize("policy", ["evict", "ecospec", "joint", "coverage"])
def test_greedy_exact_under_every_value_model(checkpoints, references, policy, values):
    """Values only re-rank which nodes are verified: every value model keeps greedy output exact
    (`calibrated` is also the default, covered above on both architectures and drafters)."""
    target, draft = checkpoints["qwen3_moe"]
    predictor = "oracle" if policy in ("ecospec", "joint") else None
    llm = LLM(str(target), draft_model=str(draft), policy=policy, predictor=predictor, values=values,
              **_speculating(policy, "qwen3_moe"))
    assert llm.engine.values is not None and llm.engine.values.name == values
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    for i, out in enumerate(outs):
        assert out.token_ids == references["qwen3_moe", i], f"{policy}/values={values} diverged on prompt {i}"
    _assert_speculated(outs, policy)


def test_joint_without_its_expert_term_runs_no_predictor_and_stays_exact(checkpoints, references):
    """The profile decides (core/cost.py expert_term_pays): joint then selects as evict on the measured C(k),
    loads no predictor and predicts nothing; greedy output is still transformers', speculating."""
    target, draft = checkpoints["qwen3_moe"]
    llm = LLM(str(target), draft_model=str(draft), policy="joint", predictor="oracle", **expert_term_off("qwen3_moe"))
    assert not llm.engine.policy.reads_experts and llm.engine.predictor is None
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True), max_batch_size=1)
    for i, out in enumerate(outs):
        assert out.token_ids == references["qwen3_moe", i]
        assert all(s.predictor_total == 0 for s in out.steps)  # no expert set was predicted
    _assert_speculated(outs, "joint")
    kept = LLM(str(target), draft_model=str(draft), policy="joint", predictor="oracle",
               policy_options={"expert_term": True}, **expert_term_off("qwen3_moe"))  # the user's word wins
    assert kept.engine.policy.reads_experts and kept.engine.predictor is not None
