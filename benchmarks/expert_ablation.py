"""Does every expert of a target change its output? Each expert zeroed in turn on the held-out window that
routes most tokens to it (`training/ablation.ablate_where_routed`), so a rarely routed expert is judged on
text that reaches it, not on a few fixed windows that may route none of their tokens to it. Its output is its
logits there (`experts_changing_output`); the window's mean loss (`experts_changing_loss`) can land on the same
float32 value while single tokens' losses move both ways.

    python -m benchmarks.expert_ablation [--target DIR] [--data runs/base/data] [--window-tokens 256] [--json PATH]
Prints the experts that change nothing (if any) and a summary line (also written to --json).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path


def summarize(rows: list) -> dict:
    """The summary of `ablate_where_routed`'s rows."""
    deltas = [abs(r.loss_delta) for r in rows]
    return {"num_experts": len(rows),
            "experts_changing_output": sum(r.logit_change > 0 for r in rows),
            "min_logit_change": min(r.logit_change for r in rows),
            "experts_changing_loss": sum(r.loss_delta != 0 for r in rows),
            "experts_changing_top1": sum(r.top1_changed > 0 for r in rows),
            "min_abs_loss_delta": min(deltas),
            "min_total_pairs": min(r.total_pairs for r in rows),
            "min_window_pairs": min(r.window_pairs for r in rows)}


def main(argv=None) -> dict:
    from benchmarks.layer_ablation import target_and_heldout
    from trtllm_moespec.training.ablation import ablate_where_routed

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="trtllm_moespec/assets/moespec-base/target")
    ap.add_argument("--data", default="runs/base/data", help="the family's encoded corpus (make_base.sh tokenizer)")
    ap.add_argument("--window-tokens", type=int, default=256)
    ap.add_argument("--max-windows", type=int, default=None, help="held-out windows searched (default: all)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    model, windows = target_and_heldout(args.target, args.data, args.window_tokens, args.max_windows, args.threads)
    rows = ablate_where_routed(model, windows)
    for r in rows:
        if r.loss_delta == 0 or r.top1_changed == 0:
            print(f"layer {r.layer:2d} expert {r.expert:2d}: {r.total_pairs} routed pairs, best window {r.window} "
                  f"({r.window_pairs}): loss {r.loss_delta:+.2e}, top-1 changed at {r.top1_changed} positions, "
                  f"logits by up to {r.logit_change:.2e}")
    out = {"target": args.target, "windows": len(windows), "window_tokens": args.window_tokens} | summarize(rows)
    print(json.dumps(out))
    if args.json:
        Path(args.json).write_text(json.dumps(out | {"experts": [asdict(r) for r in rows]}) + "\n")
    return out


if __name__ == "__main__":
    main()
