"""EAGLE-3 drafting cost on moespec-tiny, part by part (issue 12 item 3).

Times, on the same prompt and committed cache:
- `extend_ms`: one drafter forward over 4 committed tokens (a typical commit after a verify step);
- `tree_fwd_ms`: one drafter forward over an 8-node frontier (one tree expansion);
- `draft_ms`: a whole `draft_tree(steps, topk)` (its forwards plus the bookkeeping);
- `bookkeeping_ms`: draft_ms minus the tree forwards it ran;
- `step_ms`: an eagle3 decode step of a greedy generation (decode time / steps), split as bench_engine
  does into the target's time, the drafter forwards' (its prefill forward excluded) and the rest
  (`step_overhead_ms`);
  `ms_per_token` = step_ms / Mat.

One run measures one source tree (whatever `trtllm_moespec` imports). To compare two trees, give
`--compare OTHER_ROOT`: runs alternate between this tree and OTHER_ROOT in fresh processes
(interleaved, so machine drift hits both alike) and ratios new/other are printed.

    python -m benchmarks.bench_drafter [--rounds 3] [--reps 30] [--context 200] [--compare OTHER_ROOT]
        [--draft-model DIR] [--compile] [--json PATH]

`--compile` compares, the same way, the eager drafter with its forward compiled by `torch.compile`
(dynamic shapes; the issue-12 question whether compiling the drafter pays on CPU): variants
"eager" and "compiled" of this tree, ratios compiled/eager.

`--context 2000` measures drafting at long context (the drafter attends to every committed position;
context + tokens must stay within what the model's positions allow).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

GENERATIONS = 5  # greedy generations per process; the step parts are their medians
CONTEXT = 200  # default prompt tokens: the standard library's os.py (repeated when --context asks for more)
KEYS = ("extend_ms", "tree_fwd_ms", "draft_ms", "bookkeeping_ms", "step_ms", "step_target_ms", "step_drafter_fwd_ms",
        "step_overhead_ms", "ms_per_token")


def _best_of(fn, reps: int) -> float:
    """Median wall time of `fn` over `reps` calls, in ms."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def measure(reps: int, tokens: int, steps: int, topk: int, draft_model: str | None = None,
            context: int = CONTEXT, compiled: bool = False) -> dict:
    """The parts' times in this process (see the module docstring); draft_model: a drafter directory
    (default: moespec-tiny's shipped one); compiled: the drafter's inference forward through
    `torch.compile(dynamic=True)` (compiled during the warm-up generation, not timed)."""
    from trtllm_moespec import LLM, SamplingParams, TreeConfig

    torch.set_num_threads(1)
    llm = LLM("moespec-tiny", policy="eagle3", tree=TreeConfig(steps, topk, 32), draft_model=draft_model)
    drafter = llm.engine.draft_source.drafter
    if compiled:  # an instance attribute: this process's drafter only
        drafter._forward_fused = torch.compile(drafter._forward_fused, dynamic=True)
    text = Path(os.__file__).read_text()
    ids = llm.encode([text * (1 + context // 1000)])[0][:context]  # os.py is ~10k tokens; repeat if asked more
    if len(ids) < context:
        raise SystemExit(f"--context {context}: the prompt text has only {len(ids)} tokens")
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    llm.generate([ids], params)  # warm-up (and, compiled, the compilation of the shapes a step meets)
    if compiled:
        llm.generate([ids], params)
    forward, fwd_s, calls = type(drafter).forward, [0.0], [0]

    def timed_forward(*a, **k):  # the drafter forwards' share of the step (benchmark instrumentation only)
        t0 = time.perf_counter()
        try:
            return forward(drafter, *a, **k)
        finally:
            calls[0] += 1
            if calls[0] > 1:  # a generation's first drafter forward is its prefill, not part of a step
                fwd_s[0] += time.perf_counter() - t0

    drafter.forward = timed_forward
    parts = []  # (step, target, drafter forwards) ms per step of each generation
    try:
        for _ in range(GENERATIONS):
            fwd_s[0], calls[0] = 0.0, 0
            out = llm.generate([ids], params)[0]
            n = max(out.stats.num_steps, 1)
            parts.append((out.stats.decode_s * 1e3 / n, out.stats.target_ms, fwd_s[0] * 1e3 / n))
    finally:
        del drafter.forward
    step_ms, target_ms, step_fwd_ms = (statistics.median(p[i] for p in parts) for i in range(3))

    with torch.no_grad():
        prompt = torch.tensor([ids])
        hidden = llm.target.forward_windows(prompt).hidden.to(drafter.fc.weight.dtype)  # real target features
        cache = drafter.new_cache()
        drafter.prefill(cache, prompt, hidden, next_token=int(ids[-1]))
        S = cache.num_tokens
        four_ids, four_hidden = prompt[:, -4:], hidden[:, -4:]

        def extend():
            cache.num_tokens = S
            drafter.extend(cache, four_ids, four_hidden)

        extend_ms = _best_of(extend, reps)
        cache.num_tokens = S
        drafter.extend(cache, four_ids, four_hidden)
        num_forwards = drafter.draft_tree(cache, steps, topk).num_forwards
        draft_ms = _best_of(lambda: drafter.draft_tree(cache, steps, topk), reps)
        F_ = topk
        h = torch.randn(1, F_, drafter.config.hidden_size, dtype=drafter.fc.weight.dtype)
        tok = prompt[:, -F_:]
        pos = torch.full((1, F_), cache.num_tokens, dtype=torch.int64)
        mask = torch.zeros(1, 1, F_, cache.num_tokens + F_, dtype=h.dtype)
        kv = cache.kv

        def tree_fwd():
            drafter(h, input_ids=tok, position_ids=pos, attention_mask=mask, cache_kv=kv, cache_start=cache.num_tokens)

        tree_fwd_ms = _best_of(tree_fwd, reps)
    return dict(extend_ms=extend_ms, tree_fwd_ms=tree_fwd_ms, draft_ms=draft_ms,
                bookkeeping_ms=draft_ms - num_forwards * tree_fwd_ms, step_ms=step_ms, step_target_ms=target_ms,
                step_drafter_fwd_ms=step_fwd_ms, step_overhead_ms=step_ms - target_ms - step_fwd_ms,
                mean_accepted_tokens=out.stats.mean_accepted_tokens, token_ids=out.token_ids,
                ms_per_token=step_ms / out.stats.mean_accepted_tokens,
                draft_vocab_size=drafter.config.draft_vocab_size)


def _run_in(root: Path, args, compiled: bool = False) -> dict:
    """`measure` in a fresh process importing trtllm_moespec from `root`."""
    draft = None if args.draft_model is None else str(args.draft_model.resolve())
    code = ("import importlib.util, json\n"  # this file's measure(), the package from `root`
            f"spec = importlib.util.spec_from_file_location('bench_drafter', {str(Path(__file__).resolve())!r})\n"
            "mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)\n"
            f"print(json.dumps(mod.measure({args.reps}, {args.tokens}, {args.steps}, {args.topk}, {draft!r}, "
            f"{args.context}, {compiled})))\n")
    env = dict(os.environ, PYTHONPATH=str(root))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=str(root))
    if out.returncode:
        raise SystemExit(f"bench in {root} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--context", type=int, default=CONTEXT, help="prompt tokens (drafting cost grows with them)")
    ap.add_argument("--compare", type=Path, default=None, help="another source root to interleave with")
    ap.add_argument("--draft-model", type=Path, default=None, help="drafter directory for both trees")
    ap.add_argument("--compile", action="store_true", help="compare the eager drafter with a torch.compile'd one")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    here = Path(__file__).resolve().parent.parent
    if args.compile and args.compare is not None:
        raise SystemExit("--compile compares two variants of this tree: it does not combine with --compare")
    if args.compile:  # (root, compiled) per variant; "new"/"other" keep the ratio code below
        variants = {"new": (here, True), "other": (here, False)}
    elif args.compare is None:
        variants = {"new": (here, False)}
    else:
        variants = {"new": (here, False), "other": (args.compare.resolve(), False)}
    runs = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, (root, compiled) in variants.items():
            runs[name].append(_run_in(root, args, compiled))
    result = {"load_average": os.getloadavg()[0], "rounds": args.rounds, "reps": args.reps, "context": args.context,
              "variants": {"new": "compiled", "other": "eager"} if args.compile else None}
    for name, rows in runs.items():
        result[name] = {k: statistics.median(r[k] for r in rows) for k in KEYS}
        result[name]["mean_accepted_tokens"] = rows[0]["mean_accepted_tokens"]
        result[name]["draft_vocab_size"] = rows[0]["draft_vocab_size"]
        print(name, " ".join(f"{k}={result[name][k]:.2f}" for k in KEYS),
              f"Mat={rows[0]['mean_accepted_tokens']:.2f} Vd={rows[0]['draft_vocab_size']}")
    if "other" in runs:
        result["ratio_new_over_other"] = {k: result["new"][k] / result["other"][k] for k in KEYS}
        result["same_greedy_output"] = runs["new"][0]["token_ids"] == runs["other"][0]["token_ids"]
        print("ratio new/other", " ".join(f"{k}={v:.3f}" for k, v in result["ratio_new_over_other"].items()),
              "same greedy output:", result["same_greedy_output"])
    print(json.dumps(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
