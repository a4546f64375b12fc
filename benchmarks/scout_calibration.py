"""How well a greedy scout's hit rate predicts what speculation would commit (engine/guard.py `GREEDY_SCOUT_TOP`).

Each prompt is decoded greedily with the guard off (every step speculates), so every stretch of the text has
speculative steps to compare with. One causal drafter forward over the whole text then gives the drafter's
guesses after each committed prefix, as a scout's catch-up reads them: the rank of each committed token among
them. For windows of `--window` positions (every 8 positions), the share of tokens within the top K of the
window before is turned into tokens per step as a scout does (sum of h^d for d = 0..depth) and compared with
what the speculative steps starting in the window after committed: their correlation over windows, the means,
and how often both sides of the break-even agree. No timing: the machine need not be quiet.

    python -m benchmarks.scout_calibration [--model moespec-base] [--policy joint] [--prompts 8] [--json PATH]
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch

TOPS = (1, 2, 3, 4, 8)


def committed_ranks(llm, prompt: list[int], output: list[int]) -> np.ndarray:
    """[len(output)] the rank of each output token among the drafter's guesses after the prefix before it, as
    a scout's catch-up reads them (`Eagle3Drafter.extend`; drafter position t pairs the target's hidden at t
    with token t+1 and guesses token t+2); max(TOPS) for a token outside its top max(TOPS)."""
    target, drafter = llm.target, llm.engine.draft_source.drafter
    seq = torch.tensor([prompt + output])
    with torch.no_grad():
        hidden = target.prefill(target.new_cache(), seq[:, :-1]).hidden
        guesses = drafter.extend(drafter.new_cache(), seq[:, 1:], hidden, top=max(TOPS)).tolist()  # [T - 1, top]
    ranks = []
    for j, token in enumerate(output):
        top = guesses[len(prompt) + j - 2]
        ranks.append(top.index(token) if token in top else len(top))
    return np.array(ranks)


def window_pairs(ranks: np.ndarray, step_tokens: list[int], top: int, depth: int, window: int
                 ) -> list[tuple[float, float]]:
    """(predicted, committed) per window: the scout's prediction from the `window` positions before, and the
    mean tokens of the speculative steps starting in the `window` positions after."""
    from trtllm_moespec.engine.guard import greedy_scout_tokens

    starts = np.cumsum([0] + step_tokens[:-1])
    pairs = []
    for w0 in range(0, len(ranks) - window + 1, 8):
        predicted = greedy_scout_tokens((ranks[w0:w0 + window] < top).tolist(), depth)  # the guard's own rule
        after = [c for q, c in zip(starts, step_tokens) if w0 + window <= q < w0 + 2 * window]
        if after and predicted is not None:
            pairs.append((predicted, float(np.mean(after))))
    return pairs


def main(argv=None) -> dict:
    from trtllm_moespec import LLM, SamplingParams
    from trtllm_moespec.bench.datasets import encode_prompt, load_prompts
    from trtllm_moespec.bench.methods import MethodRunner, MethodSpec

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="moespec-base")
    ap.add_argument("--policy", default="joint")
    ap.add_argument("--datasets", default="humaneval,mt_bench,gsm8k")
    ap.add_argument("--prompts", type=int, default=8, help="prompts per data set")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--window", type=int, default=16)
    ap.add_argument("--break-even", type=float, default=2.2, help="tokens per step where speculation pays")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    llm = LLM(model=args.model, policy=args.policy, guard="off", draft_stop=False, threads=None)
    runner, depth = MethodRunner(MethodSpec(args.policy, args.policy), llm), llm.engine.draft_source.steps
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, seed=0)
    limit = llm.target.max_position_embeddings - args.tokens
    pairs = {top: [] for top in TOPS}
    for ds in args.datasets.split(","):
        for p in load_prompts(ds, args.prompts):
            ids = encode_prompt(p.text, llm.tokenizer, llm.target.vocab_size, limit)
            g = runner.generate(ids, params)
            ranks = committed_ranks(llm, list(ids), list(g.token_ids))
            tokens = [s.committed_tokens for s in g.steps]
            for top in TOPS:
                pairs[top] += window_pairs(ranks, tokens, top, depth, args.window)
    rows = {}
    for top, xy in pairs.items():
        x, y = np.array(xy).T
        agree = float(np.mean((x > args.break_even) == (y > args.break_even)))
        rows[top] = {"correlation": float(np.corrcoef(x, y)[0, 1]), "predicted_mean": float(x.mean()),
                     "committed_mean": float(y.mean()), "agree_on_break_even": agree, "windows": len(x)}
        print(f"top {top}: correlation {rows[top]['correlation']:.3f}  predicted {x.mean():.2f}  "
              f"committed {y.mean():.2f}  same side of {args.break_even}: {agree:.1%}  ({len(x)} windows)")
    result = {"model": args.model, "policy": args.policy, "depth": depth, "window": args.window, "tops": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
