"""Engine speed on this CPU, every variant measured interleaved in one run (issue 12 goals).

1. `ar` through our engine (lean forward) vs transformers `generate` on the same model,
   and the engine under `model_impl="hf"` beside them: tokens/s (goal: lean >= 1.6x generate).
2. Overhead of a speculative step at k=32 (eagle3, tree 4,8,32): step time minus the target
   forward and the drafter forwards (goal <= 1.0 ms).
3. eagle3 step time, lean vs hf, on the same trees (greedy: both draft and verify the same
   tokens; goal lean <= 0.6x hf).
4. Decode tokens/s (prefill excluded) with 2000 tokens of context vs 200 (goal >= 0.8x), ar and eagle3.
5. Peak RSS of a 2000-token-context request, each impl in a fresh process (and the part of it
   the request added over the loaded model).

    python -m benchmarks.bench_engine [--model moespec-tiny] [--tokens 64] [--repeats 3]
Prints a summary, then one JSON line (also written to --json).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import torch

from trtllm_moespec import LLM, SamplingParams, TreeConfig

PROMPT = "import os\nimport sys\n\n\ndef main(argv):\n    "


class _Timed:
    """Wraps a bound method and adds up its wall time (benchmark instrumentation only).
    The first `skip` calls are not counted: the drafter's first forward is its prompt prefill,
    which belongs to time-to-first-token, not to the decode steps it would be divided by."""

    def __init__(self, fn, skip: int = 0):
        self.fn, self.seconds, self.skip = fn, 0.0, skip

    def __call__(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            if self.skip > 0:
                self.skip -= 1
            else:
                self.seconds += time.perf_counter() - t0


def _hf_generate(hf, ids: list[int], tokens: int) -> float:
    t0 = time.perf_counter()
    hf.generate(torch.tensor([ids]), max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=0)
    return tokens / (time.perf_counter() - t0)


def _context_ids(llm: LLM, length: int) -> list[int]:
    """A prompt of exactly `length` tokens: Python source text of this repository, repeated."""
    text = open(__file__).read() + open(sys.modules["trtllm_moespec.api"].__file__).read()
    ids = llm.encode([text])[0]
    while len(ids) < length:
        ids = ids + ids
    return ids[:length]


def _spec_step(llm: LLM, ids: list[int], params: SamplingParams) -> dict:
    """One eagle3 generation with the drafter's forward timed: per-step ms of each part."""
    drafter = llm.engine.draft_source.drafter
    timer = drafter.forward = _Timed(type(drafter).forward.__get__(drafter), skip=1)
    try:
        out = llm.generate([ids], params)[0]
    finally:
        del drafter.forward
    s, n = out.stats, max(out.stats.num_steps, 1)
    step = s.decode_s * 1e3 / n
    return {"token_ids": out.token_ids, "step_ms": step, "target_ms": s.target_ms, "drafter_forward_ms": timer.seconds * 1e3 / n,
            "overhead_ms": step - s.target_ms - timer.seconds * 1e3 / n, "verified_tokens": s.verified_tokens,
            "mean_accepted_tokens": s.mean_accepted_tokens, "tokens_per_s": s.tokens_per_s}


def _median(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def _decode_row(out) -> dict:
    """Decode steps alone (the first token comes from the prefill): tokens/s, ms per step, Mat."""
    s = out.stats
    return {"tokens_per_s": (s.num_tokens - 1) / s.decode_s, "step_ms": s.decode_s * 1e3 / max(s.num_steps, 1),
            "mean_accepted_tokens": s.mean_accepted_tokens}


def _peak_rss_mb(model: str, impl: str, context: int, tokens: int) -> tuple[float, float]:
    """(ru_maxrss once the model is loaded and the prompt encoded, ru_maxrss after the request)
    of a fresh process that serves one request with `context` prompt tokens."""
    code = (
        "import resource, sys, torch; torch.set_num_threads(1)\n"
        "from benchmarks.bench_engine import _context_ids\n"
        "from trtllm_moespec import LLM, SamplingParams\n"
        f"llm = LLM({model!r}, policy='eagle3', model_impl={impl!r})\n"
        f"ids = _context_ids(llm, {context})\n"
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)\n"
        f"llm.generate([ids], SamplingParams(max_tokens={tokens}, ignore_eos=True))\n"
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    before, after = (float(x) for x in out.stdout.strip().splitlines()[-2:])
    return before, after


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="moespec-tiny")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--long", type=int, default=2000, help="long-context length (0 = skip parts 4 and 5)")
    ap.add_argument("--short", type=int, default=200)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    tree = TreeConfig(4, 8, 32)
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    warm = SamplingParams(max_tokens=8, ignore_eos=True)

    ar = {impl: LLM(args.model, policy="ar", model_impl=impl) for impl in ("lean", "hf")}
    spec = {impl: LLM(args.model, policy="eagle3", tree=tree, model_impl=impl) for impl in ("lean", "hf")}
    hf = ar["hf"].target.model
    ids = ar["lean"].encode([PROMPT])[0]
    for llm in (*ar.values(), *spec.values()):
        llm.generate([ids], warm)
    _hf_generate(hf, ids, 8)

    rows = {"ar_lean": [], "ar_hf": [], "generate": [], "eagle3_lean": [], "eagle3_hf": []}
    for _ in range(args.repeats):  # interleaved, so machine drift hits every variant alike
        for impl in ("lean", "hf"):
            rows[f"ar_{impl}"].append(ar[impl].generate([ids], params)[0].stats.tokens_per_s)
        rows["generate"].append(_hf_generate(hf, ids, args.tokens))
        for impl in ("lean", "hf"):
            rows[f"eagle3_{impl}"].append(_spec_step(spec[impl], ids, params))
    if rows["eagle3_lean"][0]["token_ids"] != rows["eagle3_hf"][0]["token_ids"]:
        raise SystemExit("lean and hf eagle3 outputs differ: the step-time comparison would not be on the same trees")
    r = {
        "ar_lean_tokens_per_s": statistics.median(rows["ar_lean"]),
        "ar_hf_tokens_per_s": statistics.median(rows["ar_hf"]),
        "hf_generate_tokens_per_s": statistics.median(rows["generate"]),
    }
    r["ar_lean_vs_generate"] = r["ar_lean_tokens_per_s"] / r["hf_generate_tokens_per_s"]
    r["ar_hf_vs_generate"] = r["ar_hf_tokens_per_s"] / r["hf_generate_tokens_per_s"]
    for impl in ("lean", "hf"):
        for key in ("step_ms", "target_ms", "drafter_forward_ms", "overhead_ms", "verified_tokens",
                    "mean_accepted_tokens", "tokens_per_s"):
            r[f"eagle3_{impl}_{key}"] = _median(rows[f"eagle3_{impl}"], key)
    r["eagle3_step_lean_vs_hf"] = r["eagle3_lean_step_ms"] / r["eagle3_hf_step_ms"]

    if args.long:
        ctx = {n: _context_ids(ar["lean"], n) for n in (args.short, args.long)}
        long_rows = {(p, n): [] for p in ("ar", "eagle3") for n in ctx}
        short_params = SamplingParams(max_tokens=32, ignore_eos=True)
        for _ in range(args.repeats):
            for n, c in ctx.items():
                long_rows["ar", n].append(_decode_row(ar["lean"].generate([c], short_params)[0]))
                long_rows["eagle3", n].append(_decode_row(spec["lean"].generate([c], short_params)[0]))
        for p in ("ar", "eagle3"):
            for n in ctx:
                for key in ("tokens_per_s", "step_ms", "mean_accepted_tokens"):
                    r[f"{p}_lean_{key}_ctx{n}"] = _median(long_rows[p, n], key)
            r[f"{p}_lean_ctx{args.long}_vs_ctx{args.short}"] = (r[f"{p}_lean_tokens_per_s_ctx{args.long}"]
                                                                / r[f"{p}_lean_tokens_per_s_ctx{args.short}"])
            # The two prompts are different text, so a drafter accepts differently on them: the step-time
            # ratio is what the context length alone costs (for ar it is the tokens/s ratio).
            r[f"{p}_lean_ctx{args.long}_vs_ctx{args.short}_step"] = (r[f"{p}_lean_step_ms_ctx{args.short}"]
                                                                     / r[f"{p}_lean_step_ms_ctx{args.long}"])
        for impl in ("lean", "hf"):
            loaded, peak = _peak_rss_mb(args.model, impl, args.long, 32)
            r[f"peak_rss_mb_ctx{args.long}_{impl}"] = peak
            r[f"request_rss_mb_ctx{args.long}_{impl}"] = peak - loaded
        r["kv_cache_mb_ctx_long"] = ar["lean"].target.kv_bytes_per_token * (args.long + 32) / 2**20

    r.update(model=args.model, tokens=args.tokens, repeats=args.repeats, tree=list(tree.as_tuple()),
             torch=torch.__version__, threads=torch.get_num_threads(), machine=platform.machine(),
             load_average=os.getloadavg()[0])
    _print_summary(r, args)
    print(json.dumps(r))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=2)
    return r


def _print_summary(r: dict, args) -> None:
    print(f"engine benchmark on {args.model} ({args.tokens} tokens, median of {args.repeats}, interleaved; "
          f"load average {r['load_average']:.1f})")
    print(f"  ar, lean engine            {r['ar_lean_tokens_per_s']:8.1f} tok/s  {r['ar_lean_vs_generate']:.2f}x generate")
    print(f"  ar, hf engine              {r['ar_hf_tokens_per_s']:8.1f} tok/s  {r['ar_hf_vs_generate']:.2f}x generate")
    print(f"  transformers generate      {r['hf_generate_tokens_per_s']:8.1f} tok/s")
    for impl in ("lean", "hf"):
        print(f"  eagle3 ({impl:4s}) step {r[f'eagle3_{impl}_step_ms']:6.2f} ms = target {r[f'eagle3_{impl}_target_ms']:.2f}"
              f" + drafter fwd {r[f'eagle3_{impl}_drafter_forward_ms']:.2f} + overhead {r[f'eagle3_{impl}_overhead_ms']:.2f}"
              f" (k={r[f'eagle3_{impl}_verified_tokens']:.1f}, Mat {r[f'eagle3_{impl}_mean_accepted_tokens']:.2f})")
    print(f"  eagle3 step lean / hf      {r['eagle3_step_lean_vs_hf']:.2f}")
    if args.long:
        for p in ("ar", "eagle3"):
            print(f"  {p:6s} decode tok/s ctx {args.short}: {r[f'{p}_lean_tokens_per_s_ctx{args.short}']:.1f}, ctx {args.long}: "
                  f"{r[f'{p}_lean_tokens_per_s_ctx{args.long}']:.1f}  ratio {r[f'{p}_lean_ctx{args.long}_vs_ctx{args.short}']:.2f}"
                  f" (step time {r[f'{p}_lean_ctx{args.long}_vs_ctx{args.short}_step']:.2f}; Mat "
                  f"{r[f'{p}_lean_mean_accepted_tokens_ctx{args.short}']:.2f} -> {r[f'{p}_lean_mean_accepted_tokens_ctx{args.long}']:.2f})")
        print(f"  peak RSS, {args.long}-token context: lean {r[f'peak_rss_mb_ctx{args.long}_lean']:.0f} MB "
              f"(+{r[f'request_rss_mb_ctx{args.long}_lean']:.0f} over the loaded model), hf "
              f"{r[f'peak_rss_mb_ctx{args.long}_hf']:.0f} MB (+{r[f'request_rss_mb_ctx{args.long}_hf']:.0f}); "
              f"KV cache {r['kv_cache_mb_ctx_long']:.1f} MB")


if __name__ == "__main__":
    main()
