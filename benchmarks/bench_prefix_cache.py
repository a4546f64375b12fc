"""Prefix caching on two-turn conversations: time to the first token with and without it.

Each MT-Bench question is a two-turn conversation under one shared system prompt: turn 1's prompt is
the system prompt and the first question, turn 2's is turn 1's prompt, its answer and the second
question (what a chat client sends). Every conversation runs on two engines loaded alike, one with
`prefix_cache=8` and one without, alternating which goes first; greedy outputs must be identical
(the run aborts otherwise). Reported per policy and turn: the median prefill time (the request's
time to its first token: target prefill, plus the drafter's prompt prefill where the drafter starts
at once), and the prompt tokens the cache covered.

    python -m benchmarks.bench_prefix_cache [--policies ar,joint,eagle3] [--questions 16] [--tokens 48] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
from tqdm.auto import tqdm

SYSTEM = ("You are a careful assistant for a Python code base. Answer with short, correct code and a "
          "one-line explanation. Follow PEP 8, prefer the standard library, never invent modules, keep "
          "functions small and named after what they do, write docstrings for public functions, add type "
          "hints, handle errors explicitly with exceptions that name the problem, and do not print from "
          "library code. When asked to change earlier code, show only the changed function.\n\n")


def _turns(question: dict) -> tuple[str, str]:
    return f"User: {question['turns'][0]}\nAssistant:", f"\nUser: {question['turns'][1]}\nAssistant:"


def _conversation(llm, question: dict, params) -> tuple[list[int], list[float], list[int]]:
    """(tokens of both answers, prefill ms per turn, prompt tokens per turn) of one conversation."""
    first, second = _turns(question)
    ids = llm.encode([SYSTEM + first])[0]
    out1 = llm.generate([ids], params)[0]
    ids2 = ids + out1.token_ids + llm.encode([second])[0]
    out2 = llm.generate([ids2], params)[0]
    return out1.token_ids + out2.token_ids, [out1.stats.prefill_ms, out2.stats.prefill_ms], [len(ids), len(ids2)]


def main(argv=None) -> dict:
    from trtllm_moespec import LLM, SamplingParams

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policies", default="ar,joint,eagle3")
    ap.add_argument("--questions", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    path = os.path.join(os.path.dirname(__file__), "..", "trtllm_moespec", "data", "mt_bench", "question.jsonl")
    with open(path, encoding="utf-8") as f:
        questions = [json.loads(line) for line in f if line.strip()][:args.questions]
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    result = {"questions": len(questions), "tokens": args.tokens, "policies": {}}
    for policy in args.policies.split(","):
        llms = {False: LLM("moespec-tiny", policy=policy), True: LLM("moespec-tiny", policy=policy, prefix_cache=8)}
        for llm in llms.values():  # warm-up, then start from an empty cache
            _conversation(llm, questions[0], params)
        llms[True].engine.prefix_cache.clear()
        ms = {(c, t): [] for c in (False, True) for t in (1, 2)}
        lengths = {1: [], 2: []}
        for i, q in enumerate(tqdm(questions, desc=policy)):
            outs = {}
            for cached in ((False, True) if i % 2 == 0 else (True, False)):
                outs[cached], times, lens = _conversation(llms[cached], q, params)
                for turn in (1, 2):
                    ms[cached, turn].append(times[turn - 1])
            lengths[1].append(lens[0])
            lengths[2].append(lens[1])
            if outs[True] != outs[False]:
                raise SystemExit(f"{policy}: question {q['question_id']} decoded differently with the prefix cache")
        pc = llms[True].engine.prefix_cache
        row = {f"turn{t}_prefill_ms": statistics.median(ms[False, t]) for t in (1, 2)}
        row.update({f"turn{t}_prefill_ms_cached": statistics.median(ms[True, t]) for t in (1, 2)})
        row.update({f"turn{t}_speedup": row[f"turn{t}_prefill_ms"] / row[f"turn{t}_prefill_ms_cached"] for t in (1, 2)})
        row.update({f"turn{t}_prompt_tokens": statistics.median(lengths[t]) for t in (1, 2)},
                   hits=pc.hits, misses=pc.misses, reused_tokens=pc.reused_tokens,
                   prompt_tokens=sum(lengths[1]) + sum(lengths[2]))
        result["policies"][policy] = row
        print(f"{policy:7s} turn 1 ({row['turn1_prompt_tokens']:.0f} tokens): {row['turn1_prefill_ms']:.1f} -> "
              f"{row['turn1_prefill_ms_cached']:.1f} ms ({row['turn1_speedup']:.2f}x); turn 2 "
              f"({row['turn2_prompt_tokens']:.0f} tokens): {row['turn2_prefill_ms']:.1f} -> "
              f"{row['turn2_prefill_ms_cached']:.1f} ms ({row['turn2_speedup']:.2f}x); "
              f"{row['reused_tokens']} of {row['prompt_tokens']} prompt tokens reused")
    result["load_average"] = os.getloadavg()[0]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
