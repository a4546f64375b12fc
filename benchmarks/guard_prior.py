"""Derive a model's guard prior for sampled requests (engine/guard.py `SampledPrior`) from a `moespec bench` run
that measured an unguarded speculative method beside `ar` at the prior's temperature, and write it into the
model's policy_defaults.json (its "guard" entry; the other entries are kept).

    python -m benchmarks.guard_prior benchmarks/results/base/bench.json \\
        --out trtllm_moespec/assets/moespec-base/policy_defaults.json

tokens_per_step: the method's Mat (committed tokens per step, every step speculative), the mean over data sets.
step_ratio: its speculative step's time in `ar`'s plain steps, Mat x ar's tokens/s / its tokens/s, the same mean.
Both are rounded to 2 decimals. The tree and device are the bench's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from trtllm_moespec.engine.guard import SampledPrior
from trtllm_moespec.policy_defaults import PolicyDefaults, TunedGuard

METHOD = "joint[guard=off,stop=off]"


def derive(bench: dict, method: str = METHOD, temperature: float = 1.0) -> SampledPrior:
    """The prior the bench's `method` measured beside `ar` at `temperature` (ValueError naming what is missing)."""
    cells = {(r["dataset"], r["method"]): r for r in bench["results"] if r["temperature"] == temperature}
    datasets = sorted({d for d, m in cells if m == method})
    if not datasets:
        raise ValueError(f"the bench has no {method!r} cell at T={temperature}")
    missing = [d for d in datasets if (d, "ar") not in cells]
    if missing:
        raise ValueError(f"the bench has no 'ar' cell at T={temperature} for {', '.join(missing)}")
    mats = [cells[(d, method)]["mean_accepted_tokens"] for d in datasets]
    ratios = [cells[(d, method)]["mean_accepted_tokens"] * cells[(d, "ar")]["tokens_per_s"]
              / cells[(d, method)]["tokens_per_s"] for d in datasets]
    return SampledPrior(round(statistics.mean(mats), 2), round(statistics.mean(ratios), 2), temperature)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("bench_json")
    p.add_argument("--out", required=True, help="the model's policy_defaults.json (its 'guard' entry is replaced)")
    p.add_argument("--method", default=METHOD, help="an unguarded speculative method of the bench")
    p.add_argument("--temperature", type=float, default=1.0)
    argv = sys.argv[1:] if argv is None else argv
    args = p.parse_args(argv)
    bench = json.loads(Path(args.bench_json).read_text())
    prior = derive(bench, args.method, args.temperature)
    config = bench["config"]
    record = {"made_by": bench["command"], "derived_by": "python -m benchmarks.guard_prior " + " ".join(argv),
              "measured_as": f"{args.method} at T={args.temperature:g} beside ar: Mat and Mat x ar's tokens/s / its "
                             "tokens/s, the means over data sets",
              "evidence": args.bench_json}
    defaults = PolicyDefaults.load(args.out)
    guard = TunedGuard(prior, tuple(config["tree"]), config["device"], record)
    PolicyDefaults(defaults.model_id, defaults.policies, defaults.values, guard).save(args.out)
    print(f"{args.out}: guard prior {prior} for tree {guard.tree} on {guard.device}")


if __name__ == "__main__":
    main()
