"""Invariant 2 through the whole engine: with speculation, the first two sampled tokens
follow the target's exact distribution (seeded chi-square, deterministic)."""

from __future__ import annotations

import pytest

from tests.engine.distribution import chi_square, exact_first_tokens
from trtllm_moespec import LLM, SamplingParams

PROMPT = [3, 14, 15, 92, 65, 35]
TOP_K = 3


@pytest.mark.parametrize("policy,values", [("eagle3", "raw"), ("evict", "calibrated"), ("coverage", "head")])
def test_first_tokens_match_target_distribution(checkpoints, policy, values):
    """eagle3 (fixed tree) and cost-aware policies ranking on calibrated / learned-head values (online-updated)."""
    target, draft = checkpoints["qwen3_moe"]
    exact = exact_first_tokens(target, PROMPT, TOP_K, 2)
    llm = LLM(str(target), draft_model=str(draft), policy=policy, values=values)
    trials = 400
    counts: dict[tuple[int, int], int] = {}
    for seed in range(trials):
        out = llm.generate([PROMPT], SamplingParams(max_tokens=2, temperature=1.0, top_k=TOP_K, seed=seed,
                                                    ignore_eos=True))[0]
        key = tuple(out.token_ids)
        assert key in exact, f"emitted {key}, which has zero probability under the target"
        counts[key] = counts.get(key, 0) + 1
    stat, _ = chi_square(counts, exact, trials)
    # 99.9% quantile of chi-square with 8 degrees of freedom (at most 9 cells) is 26.1.
    assert stat < 26.1, (stat, counts, exact)


def test_same_seed_gives_same_output(checkpoints):
    target, draft = checkpoints["qwen3_moe"]
    llm = LLM(str(target), draft_model=str(draft), policy="eagle3")
    params = SamplingParams(max_tokens=12, temperature=0.9, seed=7, ignore_eos=True)
    assert llm.generate([PROMPT], params)[0].token_ids == llm.generate([PROMPT], params)[0].token_ids
