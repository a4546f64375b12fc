"""The engine with bucketed static-shape verify forwards (`TargetModel.use_verify_runner("static")`:
the function `VerifyGraphs` captures on CUDA, run eagerly) decodes exactly what plain decoding does,
for ar, eagle3 and joint, on Qwen3-MoE and GPT-OSS; and the `cuda_graphs` option's checks."""

from __future__ import annotations

import pytest

from trtllm_moespec import LLM, SamplingParams
from trtllm_moespec.models.cuda_graphs import verify_buckets

PROMPTS = [[5, 17, 33, 2, 9, 100, 4], [1, 2, 3, 1, 2, 3, 1, 2]]
MAX_TOKENS = 20  # > 2 * the GPT-OSS test window (8)


def _llm(checkpoints, arch, policy, **kwargs):
    target, draft = checkpoints[arch]
    predictor = "oracle" if policy == "joint" else None
    return LLM(str(target), draft_model=str(draft), policy=policy, predictor=predictor, **kwargs)


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_static_verify_engine_equals_plain_decoding(checkpoints, arch):
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    plain = [o.token_ids for o in _llm(checkpoints, arch, "ar").generate(PROMPTS, params)]
    for policy in ("ar", "eagle3", "joint"):
        llm = _llm(checkpoints, arch, policy)
        assert llm.cuda_graphs is False and llm.target.verify_runner is None  # CPU default: eager
        llm.target.use_verify_runner("static", verify_buckets(llm.tree.max_draft_tokens))
        outs = llm.generate(PROMPTS, params)
        assert [o.token_ids for o in outs] == plain, f"{policy} with the static verify diverged"
        assert llm.target._runners, "the static path was never used"
        if policy != "ar":
            assert sum(o.stats.verified_tokens for o in outs) > 0


def test_cuda_graphs_option_is_checked_before_loading(checkpoints):
    target, _ = checkpoints["qwen3_moe"]
    with pytest.raises(ValueError, match="cuda_graphs=True needs a CUDA device"):
        LLM(str(target), policy="ar", cuda_graphs=True)
    with pytest.raises(ValueError, match="cuda_graphs must be"):
        LLM(str(target), policy="ar", cuda_graphs="yes")
    assert LLM(str(target), policy="ar", cuda_graphs=False).cuda_graphs is False
