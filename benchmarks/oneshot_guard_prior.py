"""One-shot sampled generation, as one `moespec generate --temperature 1` call (or one `LLM.generate` of several
prompts, `--batch`): a fresh process loads moespec-base, generates 96 tokens at T=1 and prints the wall time of
`generate` and its speculative request-steps. Variants: ar; joint (the guard starting from the model's sampled prior,
engine/guard.py `SampledPrior`); joint-noprior (the prior set to None before generating).

The committed runs loop over the variants interleaved, a fresh process each:

    # benchmarks/results/base/guard_prior_oneshot_t1.txt: 3 prompts x seeds 1, 2
    for seed in 1 2; do for p in P1 P2 P3; do for v in ar joint joint-noprior; do
      python -m benchmarks.oneshot_guard_prior $v --prompt "$p" --seed $seed; done; done; done
    # benchmarks/results/base/guard_prior_oneshot_batch_t1.txt: 3 rounds of the 4 prompts below, batched
    for r in 1 2 3; do for v in ar joint joint-noprior; do python -m benchmarks.oneshot_guard_prior $v --batch; done; done
"""

from __future__ import annotations

import argparse
import time

import torch

from trtllm_moespec import LLM, SamplingParams

BATCH_PROMPTS = ["Write a Python function that checks whether a number is prime.",
                 "Explain why the sky is blue to a child.", "A farmer has 12 cows and buys 7 more. How many cows?",
                 "List three uses of a hash map."]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("variant", choices=["ar", "joint", "joint-noprior"])
    p.add_argument("--prompt", default=BATCH_PROMPTS[0])
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--batch", action="store_true", help="the 4 BATCH_PROMPTS in one generate call (seed 3)")
    args = p.parse_args()
    torch.set_num_threads(1)
    llm = LLM("moespec-base", policy="ar" if args.variant == "ar" else "joint")
    if args.variant == "joint-noprior":
        llm.engine.guard.prior = None  # the batched engine reads it from here too
    prompts, seed = (BATCH_PROMPTS, 3) if args.batch else ([args.prompt], args.seed)
    params = SamplingParams(max_tokens=96, temperature=1.0, seed=seed, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, max_batch_size=len(prompts))
    wall = time.perf_counter() - t0
    print(f"{args.variant}\t{wall:.3f}\t{sum(1 for o in outs for s in o.steps if s.verified_tokens)}")


if __name__ == "__main__":
    main()
