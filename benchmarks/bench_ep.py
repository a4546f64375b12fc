"""Expert parallelism on this CPU: 1 process vs 2 ranks, and joint with / without EP-aware pricing.

    mpirun -n 2 python -m benchmarks.bench_ep [--model moespec-tiny] [--tokens 48] [--repeats 2] [--json PATH]
                                              [--ep-profile PATH]   # from `mpirun -n 2 moespec profile --ep 2`

Everything runs in one 2-rank job, interleaved per prompt so machine drift hits every
variant alike: rank 0 also holds a plain one-process LLM (rank 1 then waits on a
blocking socket, using no CPU). On a 2-core CPU the 2-rank variants measure the
**cost of expert parallelism** (an all-reduce of [T, top-k, H] slot outputs after every
MoE layer over gloo/TCP, command broadcasts, and two processes sharing two cores), not
a speed-up: the experts of moespec-tiny fit one core's cache and the ranks compete for
the same cores. A speed-up needs each rank on its own device (GPUs), where the busiest
rank's expert union is what a step waits for.

Prints a summary, then one JSON line (also written to --json, markdown beside it).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
from pathlib import Path

from trtllm_moespec import LLM, SamplingParams
from trtllm_moespec.bench.datasets import load_prompts
from trtllm_moespec.parallel.run import run_expert_parallel

VARIANTS = (  # (name, policy, ep, ep_pricing, cost profile: the model's own or the 2-rank one)
    ("1 process / eagle3", "eagle3", False, False, "own"),
    ("2 ranks / eagle3", "eagle3", True, False, "own"),
    ("1 process / joint", "joint", False, False, "own"),
    ("2 ranks / joint, global pricing", "joint", True, False, "own"),
    ("2 ranks / joint, EP-aware pricing", "joint", True, True, "own"),
    ("2 ranks / joint, global pricing, EP profile", "joint", True, False, "ep"),
    ("2 ranks / joint, EP-aware pricing, EP profile", "joint", True, True, "ep"),
)
FIELDS = ("tokens_per_s", "mean_accepted_tokens", "verified_tokens", "target_ms", "step_ms", "unique_experts_per_layer",
          "busiest_rank_experts_per_layer")


def _measure(args, ctx) -> dict:
    llms = {name: LLM(args.model, policy=policy, ep=ctx if ep else None, ep_pricing=pricing,
                      cost_profile=args.ep_profile if profile == "ep" else None)
            for name, policy, ep, pricing, profile in VARIANTS if profile == "own" or args.ep_profile}
    prompts = [p.text for p in load_prompts(args.dataset, args.prompts)]
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    for llm in llms.values():  # warm-up
        llm.generate([prompts[0]], SamplingParams(max_tokens=8, ignore_eos=True))
    runs = {name: [] for name in llms}
    tokens = {}
    for _ in range(args.repeats):
        for i, prompt in enumerate(prompts):
            for name, llm in llms.items():  # interleaved per prompt
                out = llm.generate([prompt], params)[0]
                runs[name].append(out.stats)
                tokens.setdefault(i, out.token_ids)
                if out.token_ids != tokens[i]:
                    raise RuntimeError(f"{name} diverged from the other variants on prompt {i} (greedy must agree)")
    return {name: _aggregate(stats) for name, stats in runs.items()}


def _aggregate(stats: list) -> dict:
    steps = [s for s in stats if s.num_steps]
    out = {"tokens_per_s": statistics.median(s.tokens_per_s for s in stats),
           "mean_accepted_tokens": statistics.mean(s.mean_accepted_tokens for s in steps),
           "verified_tokens": statistics.mean(s.verified_tokens for s in steps),
           "target_ms": statistics.median(s.target_ms for s in steps),
           "step_ms": statistics.median(s.decode_s * 1e3 / s.num_steps for s in steps),
           "unique_experts_per_layer": statistics.mean(s.unique_experts_per_layer for s in steps)}
    ep = [s for s in steps if s.busiest_rank_experts_per_layer is not None]
    if ep:
        out["busiest_rank_experts_per_layer"] = statistics.mean(s.busiest_rank_experts_per_layer for s in ep)
        out["unique_experts_per_rank"] = [statistics.mean(s.unique_experts_per_rank[r] for s in ep)
                                          for r in range(len(ep[0].unique_experts_per_rank))]
    return out


def _markdown(result: dict) -> str:
    rows = ["| variant | " + " | ".join(FIELDS) + " | per-rank experts/layer |", "|---" * (len(FIELDS) + 2) + "|"]
    for name, r in result["variants"].items():
        cells = [f"{r[f]:.2f}" if isinstance(r.get(f), float) else "-" for f in FIELDS]
        per_rank = "/".join(f"{x:.2f}" for x in r.get("unique_experts_per_rank", [])) or "-"
        rows.append(f"| {name} | " + " | ".join(cells) + f" | {per_rank} |")
    return "\n".join(rows) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="moespec-tiny")
    ap.add_argument("--dataset", default="humaneval")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", default=None)
    ap.add_argument("--ep-profile", default=None, help="cost profile measured with 2 ranks (C(k, U_max) fit)")
    args = ap.parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    def lead(ctx) -> int:
        load = os.getloadavg()
        variants = _measure(args, ctx)
        base = {p: variants[f"1 process / {p}"]["tokens_per_s"] for p in ("eagle3", "joint")}
        for name, r in variants.items():
            r["tokens_per_s_vs_1_process"] = r["tokens_per_s"] / base[name.rsplit("/ ", 1)[1].split(",")[0]]
        result = {"bench": "ep_cpu", "model": args.model, "dataset": args.dataset, "prompts": args.prompts,
                  "tokens": args.tokens, "repeats": args.repeats, "ranks": ctx.group.world_size,
                  "cpu": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
                  "load_avg_before": load, "load_avg_after": os.getloadavg(), "variants": variants,
                  "command": "mpirun -n 2 python -m benchmarks.bench_ep " + " ".join(argv or sys.argv[1:])}
        print(_markdown(result))
        print(json.dumps(result))
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
            Path(args.json).with_suffix(".md").write_text(_markdown(result))
        return 0

    return run_expert_parallel("cpu", 1, lead)


if __name__ == "__main__":
    sys.exit(main())
