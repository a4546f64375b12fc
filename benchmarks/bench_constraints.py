"""What logit rules and structured output cost: tokens/s, tokens per step and the time spent
masking, for plain decoding and eagle3 side by side, without and with each constraint.

Each (constraint, policy) cell generates greedily from the same code prompts; cells are interleaved
over repeats and the median is reported. Greedy outputs of ar and eagle3 must agree under every
constraint (the run aborts otherwise). "rules ms/step" is the time in `processed_logits` (penalties,
bias, min_tokens, the grammar's masks) per engine step.

    python -m benchmarks.bench_constraints [--repeats 3] [--tokens 64] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

PROMPTS = ["def add(a, b):\n", "import os\n", "class Stack:\n", "for i in range(10):\n", "def fibonacci(n):\n",
           "# read a file\n"]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "args": {"type": "array", "items":
          {"type": "string"}}, "returns": {"type": "string"}}, "required": ["name", "args", "returns"]}


def _constraints():
    from trtllm_moespec import StructuredOutput

    return {"none": {}, "penalties": {"repetition_penalty": 1.2, "frequency_penalty": 0.3},
            "json_schema": {"structured": StructuredOutput.of(json_schema=SCHEMA)},
            "regex": {"structured": StructuredOutput.of(regex=r"(def|class) [a-z_]{1,12}\([a-z, ]{0,20}\):")}}


def _run(llm, ids: list[list[int]], params, timer: list[float]) -> dict:
    timer[0] = 0.0
    outs = llm.generate(ids, params, max_batch_size=1)  # per-request step timings: one at a time
    steps = sum(o.stats.num_steps for o in outs)
    tokens = sum(len(o.token_ids) for o in outs)
    decode_s = sum(o.stats.decode_s for o in outs)
    return {"tokens": [o.token_ids for o in outs], "tokens_per_s": tokens / max(decode_s, 1e-9),
            "mat": tokens / max(steps, 1), "rules_ms_per_step": timer[0] * 1e3 / max(steps, 1)}


def main(argv=None) -> dict:
    from trtllm_moespec import LLM, SamplingParams
    import trtllm_moespec.engine.engine as engine_module

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    timer = [0.0]
    processed = engine_module.processed_logits

    def timed(*a):
        t0 = time.perf_counter()
        out = processed(*a)
        timer[0] += time.perf_counter() - t0
        return out

    engine_module.processed_logits = timed
    llms = {policy: LLM("moespec-tiny", policy=policy) for policy in ("ar", "eagle3")}
    ids = llms["ar"].encode(PROMPTS)
    constraints = _constraints()
    rows: dict[tuple[str, str], list[dict]] = {}
    for policy, llm in llms.items():  # warm-up (grammar compilation included)
        for extra in constraints.values():
            llm.generate(ids[:1], SamplingParams(max_tokens=8, **extra))
    for _ in range(args.repeats):
        for name, extra in constraints.items():
            for policy, llm in llms.items():
                rows.setdefault((name, policy), []).append(_run(llm, ids, SamplingParams(max_tokens=args.tokens, **extra),
                                                                timer))
            if rows[name, "ar"][-1]["tokens"] != rows[name, "eagle3"][-1]["tokens"]:
                raise SystemExit(f"eagle3 and ar decoded different tokens under {name}: not lossless")
    result = {"repeats": args.repeats, "tokens": args.tokens, "prompts": len(PROMPTS), "cells": {}}
    print(f"{'constraint':12s} {'policy':7s} {'tok/s':>8s} {'Mat':>5s} {'rules ms/step':>14s} {'vs ar':>6s}")
    for (name, policy), rs in rows.items():
        cell = {k: statistics.median(r[k] for r in rs) for k in ("tokens_per_s", "mat", "rules_ms_per_step")}
        cell["vs_ar"] = cell["tokens_per_s"] / statistics.median(r["tokens_per_s"] for r in rows[name, "ar"])
        result["cells"][f"{name}/{policy}"] = cell
        print(f"{name:12s} {policy:7s} {cell['tokens_per_s']:8.1f} {cell['mat']:5.2f} {cell['rules_ms_per_step']:14.3f} "
              f"{cell['vs_ar']:5.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
