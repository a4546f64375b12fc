"""One side of a side-by-side (A/B) comparison: decode the bench's first prompts with one policy setting and
print one JSON line of its speed and speculative-step anatomy. Alternate calls (A, B, A, B, ...) to compare
settings, or run it from two checkouts (`PYTHONPATH=<checkout>`) to compare code.

    python -m benchmarks.policy_ab --policy joint --options '{"expert_term": true}' --guard off

Greedy, 1 thread, one request at a time (`SpecEngine`), after an untimed 16-token warm-up generation.
`spec_share` is the share of steps that speculated; `mat`, `verified`, `pred_ms`, `select_ms` and `step_ms` are
means over the speculative steps.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def main(argv=None) -> dict:
    import torch

    from trtllm_moespec import LLM, SamplingParams
    from trtllm_moespec.bench.datasets import load_prompts

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="moespec-base")
    ap.add_argument("--policy", default="joint")
    ap.add_argument("--options", default="{}", help="policy_options as JSON, e.g. '{\"expert_term\": true}'")
    ap.add_argument("--guard", default="auto")
    ap.add_argument("--prompts", type=int, default=3, help="prompts per data set (HumanEval, MT-Bench, GSM8K)")
    ap.add_argument("--tokens", type=int, default=96)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    llm = LLM(args.model, policy=args.policy, policy_options=json.loads(args.options) or None, guard=args.guard)
    prompts = [p.text for ds in ("humaneval", "mt_bench", "gsm8k") for p in load_prompts(ds, args.prompts)]
    llm.generate(prompts[:1], SamplingParams(max_tokens=16), max_batch_size=1)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=args.tokens, temperature=0.0), max_batch_size=1)
    seconds = time.perf_counter() - t0
    steps = [s for o in outs for s in o.steps]
    spec = [s for s in steps if s.speculated]
    mean = lambda xs: statistics.fmean(xs) if xs else 0.0  # noqa: E731
    row = dict(tok_s=sum(len(o.token_ids) for o in outs) / seconds, spec_share=len(spec) / max(len(steps), 1),
               mat=mean([s.committed_tokens for s in spec]), verified=mean([s.verified_tokens for s in spec]),
               pred_ms=mean([s.predictor_ms for s in spec]), select_ms=mean([s.select_ms for s in spec]),
               step_ms=mean([s.step_ms for s in spec]))
    print(json.dumps(row))
    return row


if __name__ == "__main__":
    main()
