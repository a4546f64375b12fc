"""Add the within-k expert fields (`c_exp_within`, `unique_spread`: refit from the profile's stored samples
exactly as `moespec profile` fits) and `expert_overhead` (timed now) to an existing cost profile, without
re-measuring C(k). How moespec-base's shipped profile got them (2026-12-03):

    python benchmarks/add_expert_fields.py moespec-base trtllm_moespec/assets/moespec-base/cost_profile.json
"""

from __future__ import annotations

import json
import sys

import torch

from trtllm_moespec.api import LLM
from trtllm_moespec.bench.datasets import encode_prompt
from trtllm_moespec.core.cost import CostTable
from trtllm_moespec.profiling import default_prompts, fit_expert_model, measure_expert_overhead
from trtllm_moespec.profiling.measure import StepSample


def main(model: str, path: str) -> None:
    torch.set_num_threads(1)
    with open(path) as f:
        data = json.load(f)
    s = data["measured"]["samples"]
    fit, _ = fit_expert_model([StepSample(k, k, u, t, 0.0) for k, u, t in zip(s["k"], s["unique_experts"], s["seconds"])])
    old = data["expert_model"]  # the same fit as stored (samples are kept rounded to 0.1 us)
    assert abs(fit.c_exp / old["c_exp"] - 1) < 1e-4 and abs(fit.c0 / old["c0"] - 1) < 1e-4, (fit, old)
    table = CostTable.from_json(data)
    llm = LLM(model=model, policy="eagle3", threads=None, cost_profile=table)
    ids = [encode_prompt(p, llm.tokenizer, llm.target.vocab_size, 1024) for p in default_prompts()]
    data["expert_model"].update(c_exp_within=fit.c_exp_within, unique_spread=fit.unique_spread)
    data["expert_overhead"] = measure_expert_overhead(llm, table, ids)
    data["method"] += ("; c_exp_within / unique_spread refit from these samples and expert overhead = median joint "
                       "(predictor + select) - median evict select over interleaved guard-off greedy steps, both "
                       "added later (benchmarks/add_expert_fields.py)")
    with open(path, "w") as f:
        f.write(json.dumps(data, indent=1) + "\n")
    print(fit, data["expert_overhead"])


if __name__ == "__main__":
    main(*sys.argv[1:3])
