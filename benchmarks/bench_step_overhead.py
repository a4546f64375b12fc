"""A speculative step's overhead on this CPU, and where it goes (issue 25, goal: <= 1.0 ms).

The overhead is the step minus the target's verify forward minus the drafter's forwards (as
`bench_engine` measures it). Greedy, on the model's own tree, one request, 1 thread, every step
speculative: eagle3 (`--policy`; or a cost-aware policy, whose node values, selection and their
online update add to the step). The compiled host work (the drafting step, models/eagle3/fused_step.py;
the node values, core/values_host.py) and the torch/numpy path it replaces, interleaved in one
process (same tokens, checked). Each variant's overhead is split into
the engine's timed parts: drafting bookkeeping (drafting minus the drafter's forwards), selection
and layout (with the predictor's, if any), acceptance, the target cache's commit and the rest of the engine's step.

    python -m benchmarks.bench_step_overhead [--model moespec-base] [--policy eagle3] [--repeats 5] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

from benchmarks.bench_engine import _Timed

PROMPT = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'
PARTS = ("drafting_bookkeeping_ms", "select_and_layout_ms", "accept_ms", "commit_ms", "engine_ms")
SWITCHES = ("MOESPEC_FUSED_DRAFT", "MOESPEC_FUSED_VALUES")  # the compiled drafting step and node values
VARIANTS = {"fused": "1", "reference": "0"}  # each variant's value of every switch


def step_parts(s, forwards_ms: float) -> dict:
    """The host parts (ms) of a step's overhead from its timings `s` (a StepStats, or GenerationStats' means),
    given the drafter forwards timed during it; the engine's own part is each caller's (see PARTS)."""
    return {"target_ms": s.target_ms, "drafter_forward_ms": forwards_ms,
            "drafting_bookkeeping_ms": s.draft_ms - forwards_ms, "select_and_layout_ms": s.select_ms + s.predictor_ms,
            "accept_ms": s.verify_ms - s.target_ms, "commit_ms": s.commit_ms}


def parts_text(v: dict) -> str:
    """The PARTS of one result row as printed: "drafting_bookkeeping 0.70, select_and_layout 0.14, ..."."""
    return ", ".join(f"{p.removesuffix('_ms')} {v[p]:.2f}" for p in PARTS)


def _run(llm, ids: list[int], params) -> dict:
    """One generation with the drafter's forwards timed: per-step ms of the step, its forwards and its parts."""
    drafter = llm.engine.draft_source.drafter
    timer = drafter.forward = _Timed(type(drafter).forward.__get__(drafter), skip=1)  # skip: the prompt prefill
    try:
        out = llm.generate([ids], params)[0]
    finally:
        del drafter.forward
    s = out.stats  # means per step
    forwards_ms = timer.seconds * 1e3 / s.num_steps
    step_ms = s.decode_s * 1e3 / s.num_steps
    return {"token_ids": out.token_ids, "step_ms": step_ms, "overhead_ms": step_ms - s.target_ms - forwards_ms,
            **step_parts(s, forwards_ms), "engine_ms": s.overhead_ms, "verified_tokens": s.verified_tokens}


def main(argv=None) -> dict:
    from trtllm_moespec import LLM, SamplingParams

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="moespec-base")
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None)
    ap.add_argument("--policy", default="eagle3",
                    help="eagle3 (every node of the tree verified) or a cost-aware policy (joint: node values, "
                         "its selection and their online update are part of its step; the guard is off)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    # the tree its cost profile names; no guard: every step speculates
    llm = LLM(args.model, policy=args.policy, guard="off")
    ids = llm.encode([PROMPT])[0]
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    saved = {k: os.environ.get(k) for k in SWITCHES}
    rows: dict[str, list[dict]] = {name: [] for name in VARIANTS}
    try:
        for name, flag in VARIANTS.items():  # warm-up (and the kernels' compilation)
            os.environ.update(dict.fromkeys(SWITCHES, flag))
            _run(llm, ids, params)
        for _ in range(args.repeats):  # interleaved, so machine drift hits both alike
            for name, flag in VARIANTS.items():
                os.environ.update(dict.fromkeys(SWITCHES, flag))
                rows[name].append(_run(llm, ids, params))
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    if rows["fused"][0]["token_ids"] != rows["reference"][0]["token_ids"]:
        raise SystemExit("the compiled and the reference paths decoded different tokens")
    keys = ("step_ms", "target_ms", "drafter_forward_ms", "overhead_ms", *PARTS, "verified_tokens")
    r = {name: {k: statistics.median(row[k] for row in rs) for k in keys} for name, rs in rows.items()}
    r.update(model=args.model, policy=args.policy, tree=list(llm.engine.tree.as_tuple()), tokens=args.tokens,
             repeats=args.repeats,
             goal_overhead_ms=1.0, load_average=os.getloadavg()[0], torch=torch.__version__)
    print(f"speculative-step overhead on {args.model}, {args.policy}, tree {r['tree']} (median of {args.repeats}, interleaved; "
          f"load average {r['load_average']:.1f})")
    for name in VARIANTS:
        v = r[name]
        print(f"  {name:9s} step {v['step_ms']:6.2f} ms = target {v['target_ms']:.2f} + drafter forwards "
              f"{v['drafter_forward_ms']:.2f} + overhead {v['overhead_ms']:.2f} ("
              + parts_text(v) + ")")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=2)
    return r


if __name__ == "__main__":
    main()
