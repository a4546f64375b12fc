"""The fixed overhead of speculating (issue 25, goal <= 1.0 ms): C(0) - a plain step - the drafter's forwards.

C(0) is a speculative step that verifies the root alone (the profile's k = 0: drafting, selection, layout,
verify, acceptance, commit, the drafter's commit forward); a plain step verifies the root without drafting.
Both run through the engine's step as `moespec profile` runs them (`profiling.measure`: the selection forced
to the top-k, the guard forced), alternated one by one on the same prompts, one torch thread, greedy. Unlike
the profile, which times one drafter forward apart on warm caches, the drafter's forwards are timed inside
the speculative steps themselves (after the target's verify has streamed its weights through the caches,
a forward costs ~10% more): what is left is the step's own host work, split into the engine's timed parts.

    python -m benchmarks.bench_c0_overhead [--model moespec-base] [--steps 300] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

from benchmarks.bench_engine import _Timed
from benchmarks.bench_step_overhead import parts_text, step_parts


def _row(s, forwards_ms: float) -> dict:
    """One step's parts (ms) from its StepStats and the drafter forwards timed during it."""
    return {"step_ms": s.step_ms, **step_parts(s, forwards_ms),
            "engine_ms": s.step_ms - s.draft_ms - s.select_ms - s.predictor_ms - s.verify_ms - s.commit_ms,
            "speculated": float(s.speculated), "verified_tokens": float(s.verified_tokens)}


def measure(model: str, steps: int, warmup: int = 10) -> dict:
    """Median parts of `steps` C(0) steps and `steps` plain steps, alternated (the order flips every round)."""
    from trtllm_moespec import LLM, SamplingParams
    from trtllm_moespec.bench.datasets import encode_prompt
    from trtllm_moespec.profiling import default_prompts
    from trtllm_moespec.profiling.measure import PLAIN, ForcedBudget, ForcedGuard, StepDriver

    llm = LLM(model, policy="eagle3")
    policy = ForcedBudget(llm.engine.tree.max_draft_tokens)
    llm.engine.policy, llm.engine.guard = policy, ForcedGuard(policy)
    limit = llm.target.max_position_embeddings
    ids = [encode_prompt(p, llm.tokenizer, llm.target.vocab_size, limit // 2) for p in default_prompts()]
    params = SamplingParams(max_tokens=min(512, limit // 2 - 1), ignore_eos=True)
    driver = StepDriver(llm.engine, lambda p: llm.make_request(p, params), ids, min_remaining=llm.engine.tree.steps + 2)
    drafter = llm.engine.draft_source.drafter
    timer = drafter.forward = _Timed(type(drafter).forward.__get__(drafter))
    rows: dict[str, list[dict]] = {"c0": [], "plain": []}
    for r in range(warmup + steps):
        for k in ((0, PLAIN) if r % 2 else (PLAIN, 0)):
            policy.k = k
            before = timer.seconds
            s = driver.step()
            forwards_ms = (timer.seconds - before) * 1e3
            if k == PLAIN:
                policy.k = 0
                driver.step()  # untimed: the drafter's catch-up over the plain step's token
            if r >= warmup:
                rows["plain" if k == PLAIN else "c0"].append(_row(s, forwards_ms))
    med = {name: {key: statistics.median(row[key] for row in rs) for key in rs[0]} for name, rs in rows.items()}
    c0, plain = med["c0"], med["plain"]
    return {"c0": c0, "plain": plain, "overhead_ms": c0["step_ms"] - plain["step_ms"] - c0["drafter_forward_ms"],
            "model": model, "steps": steps,
            "tree": list(llm.engine.tree.as_tuple()), "goal_overhead_ms": 1.0, "load_average": os.getloadavg()[0],
            "torch": torch.__version__}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="moespec-base")
    ap.add_argument("--steps", type=int, default=300, help="C(0) steps and plain steps measured (each)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    r = measure(args.model, args.steps)
    c0, plain = r["c0"], r["plain"]
    print(f"C(0) on {args.model}, tree {r['tree']} (median of {args.steps} steps each, alternated; load average "
          f"{r['load_average']:.1f})")
    print(f"  C(0) {c0['step_ms']:.2f} ms - plain {plain['step_ms']:.2f} ms - drafter forwards in the step "
          f"{c0['drafter_forward_ms']:.2f} ms = overhead {r['overhead_ms']:.2f} ms (goal {r['goal_overhead_ms']:.1f})")
    print("  C(0) parts: " + parts_text(c0)
          + f"; target {c0['target_ms']:.2f} (plain {plain['target_ms']:.2f}, its accept {plain['accept_ms']:.2f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=2)
    return r


if __name__ == "__main__":
    main()
