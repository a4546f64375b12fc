"""eagle3 step time of this code against an earlier commit's, on the same trees (issue 12's
"eagle3 step time on the same trees <= 0.6x today's").

The baseline commit is checked out into a git worktree under runs/; both codes run a greedy eagle3
generation on moespec-tiny (tree 4, 8, 32, one thread) with the BASELINE's drafter, so both draft
the same trees (checked: the same tokens in the same number of steps). Fresh processes alternate,
baseline first in each round; each reports the median step time of `--repeats` generations.

    python -m benchmarks.step_vs_commit [--commit 4543f23] [--rounds 4] [--repeats 5] [--json PATH]

4543f23 is main when issue 12 was filed (the end of wave 1: transformers forward, the drafter of
that time with its full 4096-token vocabulary).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DRAFTER = "trtllm_moespec/assets/moespec-tiny/eagle3"

# Runs under either code (only API both commits have): prints {"step_ms", "steps", "tokens"}.
CHILD = """
import json, statistics, sys, torch
torch.set_num_threads(1)
from trtllm_moespec import LLM, SamplingParams, TreeConfig
llm = LLM("moespec-tiny", draft_model=sys.argv[1], policy="eagle3", tree=TreeConfig(4, 8, 32))
ids = llm.encode(["import os\\nimport sys\\n\\n\\ndef main(argv):\\n    "])[0]
params = SamplingParams(max_tokens=64, ignore_eos=True)
llm.generate([ids], params)
rows = []
for _ in range(int(sys.argv[2])):
    out = llm.generate([ids], params)[0]
    rows.append(out.stats.decode_s * 1e3 / out.stats.num_steps)
print(json.dumps({"step_ms": statistics.median(rows), "steps": out.stats.num_steps, "tokens": out.token_ids}))
"""


def _run(code_root: Path, drafter: Path, repeats: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(code_root))
    out = subprocess.run([sys.executable, "-c", CHILD, str(drafter), str(repeats)], capture_output=True, text=True,
                         check=True, env=env, cwd="/")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--commit", default="4543f23")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    baseline = ROOT / "runs" / f"baseline-{args.commit}"
    if not baseline.exists():
        subprocess.run(["git", "worktree", "add", "--detach", "-f", str(baseline), args.commit], cwd=ROOT, check=True)
    drafter = baseline / DRAFTER
    rows = {"baseline": [], "this": []}
    for r in range(args.rounds):
        old, new = _run(baseline, drafter, args.repeats), _run(ROOT, drafter, args.repeats)
        if (old["tokens"], old["steps"]) != (new["tokens"], new["steps"]):
            raise SystemExit("the two codes decoded differently: the comparison would not be on the same trees")
        rows["baseline"].append(old["step_ms"])
        rows["this"].append(new["step_ms"])
        print(f"round {r}: baseline {old['step_ms']:.2f} ms, this {new['step_ms']:.2f} ms per step "
              f"({new['step_ms'] / old['step_ms']:.3f}x, {new['steps']} steps)")
    ratios = [n / o for o, n in zip(rows["baseline"], rows["this"])]
    result = {"commit": args.commit, "rounds": args.rounds, "repeats": args.repeats, "step_ms": rows,
              "ratio_per_round": ratios, "ratio_median": statistics.median(ratios),
              "load_average": os.getloadavg()[0]}
    print(f"this / baseline step time: median {result['ratio_median']:.3f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
