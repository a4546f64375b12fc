"""`LLM.generate` with several prompts: decoded together (the batched engine) against one at a time
(`max_batch_size=1`), per policy, interleaved over rounds; the outputs must be identical (the run
aborts otherwise). Wall time of the whole call, so the prefills count too.

    python -m benchmarks.bench_generate_batch [--prompts 8] [--tokens 48] [--rounds 3] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch


def main(argv=None) -> dict:
    from trtllm_moespec import LLM, SamplingParams
    from trtllm_moespec.bench.datasets import load_prompts

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--policies", default="ar,joint,eagle3")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    prompts = [p.text for p in load_prompts("mt_bench", args.prompts)]
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    first = None
    llms = {}
    for policy in args.policies.split(","):
        llms[policy] = LLM(policy=policy, threads=None, target_model=first)
        first = first or llms[policy].target
        llms[policy].generate(prompts[:2], params)  # warm-up, both paths
        llms[policy].generate(prompts[:2], params, max_batch_size=1)
    times: dict[str, dict[str, list[float]]] = {p: {"one_by_one": [], "batched": []} for p in llms}
    tokens = args.prompts * args.tokens
    for _ in range(args.rounds):
        for policy, llm in llms.items():
            outs = {}
            for mode, size in (("one_by_one", 1), ("batched", args.prompts)):
                t0 = time.perf_counter()
                outs[mode] = llm.generate(prompts, params, max_batch_size=size)
                times[policy][mode].append(time.perf_counter() - t0)
            if [o.token_ids for o in outs["one_by_one"]] != [o.token_ids for o in outs["batched"]]:
                raise SystemExit(f"{policy}: batched outputs differ from one-by-one outputs")
    rows = []
    for policy, t in times.items():
        one, batched = statistics.median(t["one_by_one"]), statistics.median(t["batched"])
        rows.append({"policy": policy, "one_by_one_tokens_per_s": tokens / one, "batched_tokens_per_s": tokens / batched,
                     "speedup": one / batched, "same_outputs": True})
        print(f"{policy:8s} one by one {tokens / one:7.1f} tok/s | batched {tokens / batched:7.1f} tok/s | "
              f"{one / batched:.2f}x | same outputs")
    command = " ".join(["python -m benchmarks.bench_generate_batch", *(sys.argv[1:] if argv is None else argv)])
    report = {"command": command, "prompts": args.prompts,
              "tokens": args.tokens, "rounds": args.rounds, "rows": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()
