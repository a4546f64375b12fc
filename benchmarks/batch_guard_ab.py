"""The batched engine's goodput guard side by side: data-set requests served through B slots (continuous
batching, freed slots refilled before the next step) under guard variants, interleaved with `ar`.

Arms: `ar`; `default` (the batch guard as shipped); `rules-off` (the same guard without the rules it shares with the
single-request guard for greedy batches: no hold, no earned probe budget, no scouts); `off` (no guard: every step
drafts, and the policy may still verify nothing). Each arm's engine is kept across repeats, as a server keeps its
guard. Per cell: tokens/s (prefills and all; the median of the repeats), x `ar` at the same B, the share of
request-steps that verified draft nodes and the tokens such a request-step committed (both pooled over the
repeats); at T=0 every arm's text is checked against `ar`'s (at T > 0 the texts are samples, not compared).

    python -m benchmarks.batch_guard_ab [--model moespec-base] [--policy joint-batch] [--batch-sizes 1,4,8]
        [--requests 24] [--tokens 64] [--temperature 0] [--repeats 2] [--json OUT]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from tqdm import tqdm

ARMS = ("ar", "default", "rules-off", "off")


def make_engine(llms: dict, arm: str, policy: str, batch: int):
    """The BatchedEngine of an arm at batch size `batch`."""
    from trtllm_moespec.engine.batch import BatchedEngine
    from trtllm_moespec.engine.batch_cost import GoodputGuard

    if arm == "ar":
        return BatchedEngine(llms["ar"].engine, batch)
    guard = {"default": True, "off": False,
             "rules-off": GoodputGuard(hold=0.0, winning_probe_overhead=0.0, scout_every=0)}[arm]
    return BatchedEngine(llms["spec"].engine, batch, batch_policy=policy, goodput_guard=guard)


def serve(llm, engine, prompts: list[list[int]], batch: int, params) -> dict:
    """`prompts` served through `batch` slots; what the cell reports."""
    requests = [llm.make_request(p, params) for p in prompts]
    waiting, t0 = list(requests), time.perf_counter()
    while waiting or engine.num_active:
        while waiting and engine.num_active < batch:
            engine.add(waiting.pop(0))
        engine.step()
    seconds = time.perf_counter() - t0
    steps = [s for r in requests for s in r.steps]
    spec = [s for s in steps if s.verified_tokens > 0]
    return {"tokens_per_s": sum(len(r.output_ids) for r in requests) / seconds, "steps": len(steps),
            "speculative_steps": len(spec), "speculative_tokens": sum(s.committed_tokens for s in spec),
            "outputs": [list(r.output_ids) for r in requests]}


def main(argv=None) -> dict:
    from trtllm_moespec import LLM, SamplingParams
    from trtllm_moespec.bench.report import write_json

    from .bench_batch_steps import _dataset_prompts

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="moespec-base")
    ap.add_argument("--policy", default="joint-batch", choices=("joint-batch", "evict-batch"),
                    help="the batch policy (a guard given to the engine applies to batch policies only)")
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--batch-sizes", default="1,4,8")
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    arms = args.arms.split(",")
    if "ar" not in arms or any(a not in ARMS for a in arms):
        raise SystemExit(f"--arms: a comma list of {', '.join(ARMS)} including ar")
    torch.set_num_threads(1)
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    policy = args.policy.removesuffix("-batch")
    llms = {"ar": LLM(args.model, policy="ar"), "spec": LLM(args.model, policy=policy)}
    prompts = _dataset_prompts(llms["ar"], args.requests, args.tokens)
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True, temperature=args.temperature)
    cells = [(a, b) for b in sizes for a in arms]
    engines = {(a, b): make_engine(llms, a, args.policy, b) for a, b in cells}
    for a, b in cells:  # warm-up: one-time costs, and each guard's first measurements
        serve(llms["ar" if a == "ar" else "spec"], engines[a, b], prompts[:max(b, 3)], b, params)
    rows = {cell: [] for cell in cells}
    for repeat in tqdm(range(args.repeats), desc="repeats"):  # interleaved, every other repeat in reverse
        for a, b in cells if repeat % 2 == 0 else cells[::-1]:
            rows[a, b].append(serve(llms["ar" if a == "ar" else "spec"], engines[a, b], prompts, b, params))
    result = {"model": args.model, "policy": args.policy, "requests": args.requests, "tokens": args.tokens,
              "temperature": args.temperature, "repeats": args.repeats, "cells": []}
    for a, b in cells:
        runs, ar = rows[a, b], rows["ar", b]
        speed = statistics.median(r["tokens_per_s"] for r in runs)
        spec = sum(r["speculative_steps"] for r in runs)
        cell = {"arm": a, "batch": b, "tokens_per_s": speed,
                "vs_ar": speed / statistics.median(r["tokens_per_s"] for r in ar),
                "speculative_share": spec / sum(r["steps"] for r in runs),
                "tokens_per_speculative_step": sum(r["speculative_tokens"] for r in runs) / max(spec, 1),
                "exact": all(r["outputs"] == ar[0]["outputs"] for r in runs) if args.temperature == 0 else None}
        result["cells"].append(cell)
        print(f"B={b} {a:9s} {speed:7.1f} tok/s  x ar {cell['vs_ar']:.3f}  speculative "
              f"{100 * cell['speculative_share']:5.1f}%  {cell['tokens_per_speculative_step']:.2f} tokens a "
              f"speculative step" + ("  NOT EXACT" if cell["exact"] is False else ""))
    if args.json:
        write_json(result, args.json)
    return result


if __name__ == "__main__":
    main()
