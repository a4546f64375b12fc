"""Engine overhead on this CPU, measured side by side in one run (issue: PyTorch engine).

1. `policy="ar"` through our engine vs transformers `generate` on the same model,
   interleaved repeats: tokens/s ratio (goal >= 0.9).
2. Engine bookkeeping per speculative step (layout, acceptance rule, KV commit,
   stats: everything but the draft forward, predictor, policy and target forward)
   as a share of the step (goal <= 5%).
3. RSS over a long generation: flat after warm-up apart from the KV cache.

    python -m benchmarks.bench_engine [--model moespec-tiny] [--tokens 128] [--repeats 3] [--long 2000]
Prints a summary, then one JSON line (also written to --json).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import time

import torch

from trtllm_moespec import LLM, SamplingParams

PROMPT = "import os\nimport sys\n\n\ndef main(argv):\n    "


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _hf_generate(hf, ids: list[int], tokens: int) -> float:
    t0 = time.perf_counter()
    hf.generate(torch.tensor([ids]), max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=0)
    return tokens / (time.perf_counter() - t0)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="moespec-tiny")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--long", type=int, default=2000, help="tokens of the RSS run (0 = skip)")
    ap.add_argument("--spec-policy", default="eagle3", help="policy for the bookkeeping measurement")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    ar = LLM(args.model, policy="ar")
    hf = ar.target.model
    ids = ar.encode([PROMPT])[0]
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    ar.generate([ids], SamplingParams(max_tokens=8, ignore_eos=True))
    _hf_generate(hf, ids, 8)
    ours, theirs = [], []
    for _ in range(args.repeats):  # interleaved, so machine drift hits both
        ours.append(ar.generate([ids], params)[0].stats.tokens_per_s)
        theirs.append(_hf_generate(hf, ids, args.tokens))
    result = {"ar_tokens_per_s": statistics.median(ours), "hf_generate_tokens_per_s": statistics.median(theirs)}
    result["ar_vs_hf_generate"] = result["ar_tokens_per_s"] / result["hf_generate_tokens_per_s"]

    spec = LLM(args.model, policy=args.spec_policy)
    stats = spec.generate([ids], params)[0].stats
    result.update(spec_policy=args.spec_policy, spec_tokens_per_s=stats.tokens_per_s,
                  step_ms=stats.decode_s * 1e3 / max(stats.num_steps, 1), draft_ms=stats.draft_ms,
                  select_ms=stats.select_ms, target_ms=stats.target_ms, rule_ms=stats.verify_ms - stats.target_ms,
                  commit_ms=stats.commit_ms, bookkeeping_fraction=stats.bookkeeping_fraction)

    if args.long:
        long_ids = ids[:16]
        rss = []
        for i, event in enumerate(spec.stream(long_ids, SamplingParams(max_tokens=args.long, ignore_eos=True))):
            if i % 50 == 0:
                rss.append(_rss_mb())
        kv_mb = spec.target.kv_bytes_per_token * args.long / 2**20
        warm = rss[len(rss) // 10]
        result.update(long_tokens=args.long, rss_after_warmup_mb=warm, rss_end_mb=rss[-1],
                      rss_growth_mb=rss[-1] - warm, kv_cache_mb_at_end=kv_mb,
                      peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    result.update(model=args.model, tokens=args.tokens, repeats=args.repeats, torch=torch.__version__,
                  threads=torch.get_num_threads(), machine=platform.machine(), load_average=os.getloadavg()[0])
    print(f"engine benchmark on {args.model} ({args.tokens} tokens, median of {args.repeats}, interleaved)")
    print(f"  ar through our engine      {result['ar_tokens_per_s']:8.1f} tok/s")
    print(f"  transformers generate      {result['hf_generate_tokens_per_s']:8.1f} tok/s   ratio {result['ar_vs_hf_generate']:.2f}")
    print(f"  {args.spec_policy} step {result['step_ms']:.1f} ms: bookkeeping {100 * result['bookkeeping_fraction']:.1f}%")
    if args.long:
        print(f"  RSS over {args.long} tokens: {result['rss_after_warmup_mb']:.0f} -> {result['rss_end_mb']:.0f} MB "
              f"(KV cache {result['kv_cache_mb_at_end']:.1f} MB; peak {result['peak_rss_mb']:.0f} MB)")
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
