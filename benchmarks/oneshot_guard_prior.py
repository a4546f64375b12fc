"""One-shot sampled generation, as one `moespec generate --temperature 1` call: a fresh process loads moespec-base,
generates 96 tokens for one prompt and prints the wall time of `generate` and its speculative steps. Variants:
ar, joint (the guard starting from the model's sampled prior, engine/guard.py `SampledPrior`), joint-noprior.
The committed run (benchmarks/results/base/guard_prior_oneshot_t1.txt) loops over 3 prompts x 2 seeds, the
variants interleaved:

    for seed in 1 2; do for p in P1 P2 P3; do for v in ar joint joint-noprior; do
      python -m benchmarks.oneshot_guard_prior $v "$p" $seed; done; done; done
"""
import sys, time, torch
from trtllm_moespec import LLM, SamplingParams
torch.set_num_threads(1)
variant, prompt, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
llm = LLM("moespec-base", policy="ar" if variant == "ar" else "joint")
if variant == "joint-noprior":
    llm.engine.guard.prior = None
t0 = time.perf_counter()
o = llm.generate([prompt], SamplingParams(max_tokens=96, temperature=1.0, seed=seed, ignore_eos=True))[0]
wall = time.perf_counter() - t0
print(f"{variant}\t{wall:.3f}\t{sum(1 for s in o.steps if s.verified_tokens)}")
