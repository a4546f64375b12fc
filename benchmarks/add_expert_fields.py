"""Add c_exp_within / unique_spread (refit from the stored samples, same Tukey trimming as the profile)
and expert_overhead (measured now) to a shipped cost profile."""
import json, sys
import numpy as np
from trtllm_moespec.core.cost import CostTable, ExpertCostModel
from trtllm_moespec.profiling import measure_expert_overhead, default_prompts
from trtllm_moespec.profiling.measure import StepSample, trim_outliers
from trtllm_moespec.api import LLM
from trtllm_moespec.bench.datasets import encode_prompt
import torch
torch.set_num_threads(1)
model, path = sys.argv[1], sys.argv[2]
data = json.load(open(path))
s = data["measured"]["samples"]
samples = [StepSample(k, k, u, t, 0.0) for k, u, t in zip(s["k"], s["unique_experts"], s["seconds"])]
fit_on = trim_outliers(samples)
m = ExpertCostModel.fit(np.array([x.verified_tokens for x in fit_on]), np.array([x.unique_experts for x in fit_on]),
                        np.array([x.seconds for x in fit_on]))
old = data["expert_model"]
assert abs(m.c_exp / old["c_exp"] - 1) < 1e-4 and abs(m.c0 / old["c0"] - 1) < 1e-4, (m, old)  # samples are stored rounded to 0.1 us
table = CostTable.from_json(data)
llm = LLM(model=model, policy="eagle3", threads=None, cost_profile=table)
ids = [encode_prompt(p, llm.tokenizer, llm.target.vocab_size, 1024) for p in default_prompts()]
overhead = measure_expert_overhead(llm, table, ids)
data["expert_model"]["c_exp_within"] = m.c_exp_within
data["expert_model"]["unique_spread"] = m.unique_spread
data["expert_overhead"] = overhead
data["method"] += ("; c_exp_within / unique_spread refit from these samples and expert overhead = median joint "
                   "(predictor + select) - median evict select over interleaved guard-off greedy steps, both added "
                   "later (runs/perf/add_expert_fields.py)")
print(m, overhead)
json.dump(data, open(path, "w"), indent=1); open(path, "a").write("\n")
