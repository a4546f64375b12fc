"""How much of an eagle3 step's overhead is Python work and how much is cache misses (issue 12).

Runs the same greedy eagle3 generation on moespec-tiny twice, interleaved: once for real, and once
with the target's verify forward replayed from a recording of the real run (same layouts, same
outputs, same tokens: checked). A 33-token verify streams ~50 MB of expert weights through the
caches; with it replayed, the rest of the step runs on warm caches. The overhead (step minus
target and drafter forwards, as `bench_engine` reports it) of the replayed run is the Python work;
the difference to the real run is what the verify's cache traffic adds to it.

    python -m benchmarks.overhead_split [--repeats 5] [--tokens 64] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from benchmarks.bench_engine import PROMPT, _spec_step

KEYS = ("step_ms", "target_ms", "drafter_forward_ms", "overhead_ms")


def main(argv=None) -> dict:
    from trtllm_moespec import LLM, SamplingParams, TreeConfig

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    llm = LLM("moespec-tiny", policy="eagle3", tree=TreeConfig(4, 8, 32))
    ids = llm.encode([PROMPT])[0]
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    llm.generate([ids], params)  # warm-up
    target, verify = llm.target, type(llm.target).verify
    recorded = []

    def record(cache, layout):
        out = verify(target, cache, layout)
        recorded.append(out)
        return out

    target.verify = record
    want = llm.generate([ids], params)[0].token_ids
    del target.verify
    rows = {"real": [], "verify_replayed": []}
    for _ in range(args.repeats):
        rows["real"].append(_spec_step(llm, ids, params))
        outputs = iter(recorded)

        def replay(cache, layout):
            cache.num_pending = layout.num_positions  # what the verify leaves for commit()
            return next(outputs)

        target.verify = replay
        try:
            rows["verify_replayed"].append(_spec_step(llm, ids, params))
        finally:
            del target.verify
        if rows["verify_replayed"][-1]["token_ids"] != want:
            raise SystemExit("the replayed run decoded other tokens: the recording does not match")
    result = {name: {k: statistics.median(r[k] for r in rs) for k in KEYS} for name, rs in rows.items()}
    result["cache_share_of_overhead"] = 1 - result["verify_replayed"]["overhead_ms"] / result["real"]["overhead_ms"]
    result.update(repeats=args.repeats, tokens=args.tokens, tree=[4, 8, 32])
    for name in rows:
        print(f"{name:16s}", "  ".join(f"{k} {result[name][k]:.3f}" for k in KEYS))
    print(f"cache misses' share of the overhead: {result['cache_share_of_overhead']:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
