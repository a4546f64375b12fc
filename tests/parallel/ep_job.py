"""One `mpirun -n N` job running many generation cases expert-parallel (rank 0 writes the results).

    mpirun -n 2 python -m tests.parallel.ep_job CASES.json RESULTS.json

CASES.json: a list of {"name", "model", "draft_model", "policy", "predictor", "prompts",
"max_tokens", "temperature", "seed", "ep_pricing"}. One launch serves every case, since
starting ranks (imports, rendezvous) costs more than a tiny model's generation.
"""

from __future__ import annotations

import json
import sys

from trtllm_moespec import LLM, SamplingParams
from trtllm_moespec.parallel.experts import ShardedExperts
from trtllm_moespec.parallel.run import run_expert_parallel


def run_cases(cases: list[dict], ctx) -> list[dict]:
    results = []
    for case in cases:
        llm = LLM(case["model"], draft_model=case.get("draft_model"), policy=case["policy"],
                  predictor=case.get("predictor"), ep=ctx, ep_pricing=case.get("ep_pricing", True),
                  model_impl=case.get("model_impl", "lean"), guard=case.get("guard", "auto"))
        params = SamplingParams(max_tokens=case["max_tokens"], temperature=case.get("temperature", 0.0),
                                seed=case.get("seed"), ignore_eos=True)
        outs = llm.generate(case["prompts"], params)
        results.append({"name": case["name"], "token_ids": [o.token_ids for o in outs],
                        "stats": [o.stats.to_dict() for o in outs],
                        "placement_ranks": ctx.placement.num_ranks,
                        **_shard_stats(ctx.leader),
                        "policy_placement": getattr(llm.policy, "placement", None) is not None})
    return results


def _shard_stats(target) -> dict:
    """Calls through rank 0's expert shards and their local expert counts (lean or transformers path)."""
    if target.lean is not None:
        shards = [layer.experts.module for layer in target.lean.layers if layer.experts is not None]
        local = [s.local.num_experts for s in shards]
    else:
        shards = [m for m in target.model.modules() if isinstance(m, ShardedExperts)]
        local = [s.inner.num_experts for s in shards]
    return {"sharded_calls": sum(s.num_calls for s in shards), "local_experts": local}


def main(cases_path: str, results_path: str) -> int:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    cases = json.loads(open(cases_path).read())

    def lead(ctx) -> int:
        results = run_cases(cases, ctx)
        with open(results_path, "w") as f:
            json.dump(results, f)
        return 0

    return run_expert_parallel("cpu", 1, lead)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
