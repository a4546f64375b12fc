"""Batch steps without the server: how the batched engine's decode steps scale with batch size, and
what the batch policies' guarded plain steps cost beside `ar`'s (issue 14's numbers, engine only).

For each method and batch size B, B greedy requests (prompts of 97 - B .. 96 tokens of Python
source, like `bench_serve`'s 96-token prompts) are admitted together and decoded to `--tokens` new
tokens; the time per batch step after the prefill step and the throughput (tokens committed after
the prefill step per second of their decoding: a speculative step commits several per request, so
step times alone do not compare methods) are medians over `--repeats` runs, interleaved (every
other repeat in reverse order); `vs_ar` is the throughput ratio. `full_batch_*` counts only the
steps that ran all B requests (see `_run`: the tail of a static batch). Under a serving load (`bench_serve.py`, not here)
the prefills of arriving requests run between batch steps; requests admitted in the same step are
prefilled together in one forward (`engine.batch.prefill_batch`), and the prefill of B prompts one
by one and together is timed beside each other.

    python -m benchmarks.bench_batch_steps [--batch-sizes 1,2,4,8] [--methods ar,joint,joint-batch,evict-batch]
        [--tokens 128] [--repeats 10] [--model moespec-tiny] [--json PATH]

`eagle3` (unguarded, it speculates every step) against `eagle3-one-by-one`, the same with its batch's
drafter forwards run request by request instead of packed, measures batched drafting.

With `--requests N` the batch is served as a server would: N requests (the bench's data-set prompts,
humaneval, mt_bench and gsm8k in turn) pass through B slots, a freed slot is refilled before the next
step, and every step counts (the refills' prefills too). `full_batch_*` is then the throughput at batch
size B in steady state: the steps that ran B requests, all but the drain after the last admission. Every
method's tokens are checked against `ar`'s (`exact`: greedy decoding must not change them).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import time
from typing import NamedTuple

import torch
from tqdm import tqdm

from benchmarks.bench_engine import _context_ids

PROMPT_TOKENS = 96
POLICY = {"ar": "ar", "joint": "joint", "joint-batch": "joint", "evict-batch": "evict", "eagle3": "eagle3",
          "eagle3-one-by-one": "eagle3"}


class _OneByOne:
    """A loaded draft source without its batch methods: a batch's requests draft and commit one after
    another, as before the drafter forwards were packed (the ablation of `eagle3-one-by-one`)."""

    def __init__(self, source):
        self._source = source

    def __getattr__(self, name: str):
        if name in ("draft_batch", "commit_batch"):
            raise AttributeError(name)
        return getattr(self._source, name)


def _engine(llm, method: str):
    if method != "eagle3-one-by-one":
        return llm.engine
    engine = copy.copy(llm.engine)
    engine.draft_source = _OneByOne(engine.draft_source)
    return engine


class Run(NamedTuple):
    """One batch decoded to the end."""

    step_ms: float  # ms per batch step after the prefill step
    speculative_steps: int  # request-steps that verified draft nodes
    tokens_per_s: float  # tokens committed after the prefill step over their decode time
    full_batch_tokens_per_s: float  # the same over the steps that ran all B requests
    outputs: tuple[tuple[int, ...], ...]  # each request's generated token ids, in admission order


def _run(llm, engine, ids: list[int], batch: int, params) -> Run:
    """One batch of `batch` requests decoded to the end.

    `full_batch_tokens_per_s` is the throughput at batch size B. A static batch keeps stepping until its
    slowest request is done: `ar`'s requests all finish on the same step, speculating ones one by one (a request whose text
    the drafter predicts well needs half the steps of its neighbour), so the whole-run figure also counts
    a tail of ever smaller batches that a server, refilling free slots with waiting requests, would not run."""
    requests = [llm.make_request(ids[:PROMPT_TOKENS - batch + i + 1], params) for i in range(batch)]
    for r in requests:
        engine.add(r)
    engine.step()  # the prefills and first tokens
    first = sum(len(r.output_ids) for r in requests)
    return _timed_run(engine, requests, [], batch, first)


def _serve(llm, engine, prompts: list[list[int]], batch: int, params) -> Run:
    """`prompts` served through `batch` slots with continuous batching (`BatchedEngine.run_all`'s
    admission, each step timed): the whole run, prefills included, and its steady state, the steps that
    ran `batch` requests (every step until the queue empties; then the last requests drain)."""
    requests = [llm.make_request(p, params) for p in prompts]
    return _timed_run(engine, requests, list(requests), batch, 0)


def _timed_run(engine, requests: list, waiting: list, batch: int, first: int) -> Run:
    """Step until every request is done, admitting `waiting` ones into free slots before each step; the
    tokens beyond `first` (those committed before the timing) over the time, and over the full-batch steps."""
    t0, steps, full_s, full_tokens = time.perf_counter(), 0, 0.0, 0
    while waiting or engine.num_active:
        while waiting and engine.num_active < batch:
            engine.add(waiting.pop(0))
        full, t_step = engine.num_active == batch, time.perf_counter()
        outputs, _ = engine.step()
        if full:
            full_s += time.perf_counter() - t_step
            full_tokens += sum(len(o.new_ids) for o in outputs)
        steps += 1
    seconds = time.perf_counter() - t0
    tokens = sum(len(r.output_ids) for r in requests) - first
    return Run(seconds * 1e3 / steps, _speculative_steps(requests), tokens / seconds, full_tokens / full_s,
               _outputs(requests))


def _speculative_steps(requests) -> int:
    return sum(s.verified_tokens > 0 for r in requests for s in r.steps)


def _outputs(requests) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(r.output_ids) for r in requests)


def _dataset_prompts(llm, num: int, max_tokens: int) -> list[list[int]]:
    """The first prompts of the bench's data sets, taken in turn (humaneval, mt_bench, gsm8k, humaneval, ...)."""
    from trtllm_moespec.bench.datasets import DATASETS, encode_prompt, load_prompts

    per = -(-num // len(DATASETS))
    limit = llm.target.max_position_embeddings - max_tokens
    encoded = [[encode_prompt(p.text, llm.tokenizer, llm.target.vocab_size, limit) for p in load_prompts(ds, per)]
               for ds in DATASETS]
    return [encoded[i % len(DATASETS)][i // len(DATASETS)] for i in range(num)]


def _prefill_ms(target, ids: list[int], sizes: list[int], repeats: int = 10) -> dict[int, tuple[float, float]]:
    """Per batch size B: (ms to prefill B prompts one by one, ms to prefill them in one forward,
    `engine.batch.prefill_batch`), medians of `repeats` interleaved runs."""
    from trtllm_moespec.engine.batch import prefill_batch

    times = {(b, together): [] for b in sizes for together in (False, True)}
    for _ in range(repeats):
        for (b, together), row in times.items():
            prompts = [torch.tensor([ids[:PROMPT_TOKENS - b + i + 1]]) for i in range(b)]
            caches = [target.new_cache() for _ in prompts]
            t0 = time.perf_counter()
            if together:
                prefill_batch(target, caches, prompts)
            else:
                for c, p in zip(caches, prompts):
                    target.prefill(c, p)
            row.append((time.perf_counter() - t0) * 1e3)
            del caches
    return {b: (statistics.median(times[b, False]), statistics.median(times[b, True])) for b in sizes}


def main(argv=None) -> dict:
    from trtllm_moespec import LLM, SamplingParams
    from trtllm_moespec.engine.batch import BatchedEngine

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="moespec-tiny", help="local HF directory or an embedded model")
    ap.add_argument("--batch-sizes", default="1,2,4,8")
    ap.add_argument("--methods", default="ar,joint,joint-batch,evict-batch")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--requests", type=int, default=0,
                    help="0: one static batch of B requests; N: N data-set requests served through B slots")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    if args.requests < 0 or 0 < args.requests < max(sizes):
        raise SystemExit(f"--requests: 0 (a static batch) or at least the largest batch size, got {args.requests}")
    methods = args.methods.split(",")
    if "ar" not in methods or any(m not in POLICY for m in methods):
        raise SystemExit(f"--methods: a comma list of {', '.join(POLICY)} including ar")
    llms = {p: LLM(args.model, policy=p) for p in {POLICY[m] for m in methods}}
    ids = _context_ids(llms["ar"], PROMPT_TOKENS)
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    served = _dataset_prompts(llms["ar"], args.requests, args.tokens) if args.requests else None

    def run(m: str, b: int) -> Run:
        llm = llms[POLICY[m]]
        return _run(llm, engines[m, b], ids, b, params) if served is None else _serve(llm, engines[m, b], served, b, params)

    engines = {(m, b): BatchedEngine(_engine(llms[POLICY[m]], m), b, batch_policy=m if m.endswith("-batch") else None)
               for m in methods for b in sizes}
    for m, b in engines:  # warm-up (and each guard's first measurements)
        run(m, b)
    rows = {key: [] for key in engines}
    cells = list(engines)
    for repeat in tqdm(range(args.repeats), desc="repeats"):  # interleaved, every other repeat in reverse
        for m, b in cells if repeat % 2 == 0 else cells[::-1]:  # drift hits every cell alike
            rows[m, b].append(run(m, b))
    step_ms = {key: statistics.median(r.step_ms for r in rs) for key, rs in rows.items()}
    tokens_per_s = {key: statistics.median(r.tokens_per_s for r in rs) for key, rs in rows.items()}
    full_tokens_per_s = {key: statistics.median(r.full_batch_tokens_per_s for r in rs) for key, rs in rows.items()}
    prefill = _prefill_ms(llms["ar"].target, ids, sizes)
    result = {"model": args.model, "load_average": os.getloadavg()[0], "tokens": args.tokens, "repeats": args.repeats,
              "requests": args.requests, "prefill_96_ms": prefill, "cells": []}
    for b, (alone, together) in prefill.items():
        print(f"prefill of {b} prompt(s) of {PROMPT_TOKENS - b + 1}..{PROMPT_TOKENS} tokens: one by one {alone:.2f} ms, "
              f"together {together:.2f} ms ({alone / together:.2f}x)")
    for m in methods:
        for b in sizes:
            cell = {"method": m, "batch": b, "step_ms": step_ms[m, b],
                    "tokens_per_s": tokens_per_s[m, b],
                    "vs_ar": tokens_per_s[m, b] / tokens_per_s["ar", b],
                    "vs_batch_1": tokens_per_s[m, b] / tokens_per_s[m, sizes[0]] if sizes[0] == 1 else None,
                    "full_batch_tokens_per_s": full_tokens_per_s[m, b],
                    "full_batch_vs_ar": full_tokens_per_s[m, b] / full_tokens_per_s["ar", b],
                    "speculative_steps": sum(r.speculative_steps for r in rows[m, b]),
                    "exact": all(r.outputs == rows["ar", b][0].outputs for r in rows[m, b])}
            result["cells"].append(cell)
            print(f"{m:12s} B={b}  {cell['step_ms']:.3f} ms/step  {cell['tokens_per_s']:7.1f} tok/s  "
                  f"x ar {cell['vs_ar']:.3f}" + (f"  x B=1 {cell['vs_batch_1']:.2f}" if cell["vs_batch_1"] else "")
                  + f"  full batch {cell['full_batch_tokens_per_s']:7.1f} tok/s x ar {cell['full_batch_vs_ar']:.3f}"
                  + f"  speculative steps {cell['speculative_steps']}" + ("" if cell["exact"] else "  NOT EXACT"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
