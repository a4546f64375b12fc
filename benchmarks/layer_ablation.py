"""How much each decoder layer of a target does: every layer replaced by the identity in turn (the hook of
`training/ablation.py`), then each `--group` of layers at once, on held-out windows of the model family's corpus.

Per ablation: the held-out loss increase (nats/token), the KL divergence of the ablated model's next-token
distribution from the intact one's, and the share of positions whose top-1 prediction changes. A layer that
was added to a model only to cost time would show ~0 on all three.

    python -m benchmarks.layer_ablation [--target DIR] [--data runs/base/data] [--windows 16] [--window-tokens 256]
        [--group 2-5,8-11,14-17,20-23] [--json PATH]
Prints a table, then one JSON line (also written to --json).
"""

from __future__ import annotations

import argparse
import json
from contextlib import ExitStack
from pathlib import Path

import torch
import torch.nn.functional as F


@torch.no_grad()
def _logits(model, windows: torch.Tensor, batch_size: int = 4) -> torch.Tensor:
    return torch.cat([model(input_ids=c[:, :-1], use_cache=False).logits.float() for c in windows.split(batch_size)])


def _compare(base_logits: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor, base_loss: float) -> dict:
    base_lp, lp = base_logits.log_softmax(-1), logits.log_softmax(-1)
    return {"loss_delta": F.cross_entropy(logits.flatten(0, 1), labels.flatten()).item() - base_loss,
            "kl": (base_lp.exp() * (base_lp - lp)).sum(-1).mean().item(),
            "top1_changed": (logits.argmax(-1) != base_logits.argmax(-1)).float().mean().item()}


def target_and_heldout(target: str, data: str, window_tokens: int, max_windows: int | None, threads: int):
    """The target (fp32, eval) and contiguous held-out windows [W, window_tokens + 1] of its family's corpus."""
    from transformers import AutoModelForCausalLM

    from trtllm_moespec.training.data import contiguous_windows, load_streams

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    return model, contiguous_windows(load_streams(Path(data)).heldout, window_tokens, max_windows)


def main(argv=None) -> dict:
    from trtllm_moespec.training.ablation import skip_layer
    from trtllm_moespec.training.target import parse_layers

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="trtllm_moespec/assets/moespec-base/target")
    ap.add_argument("--data", default="runs/base/data", help="the family's encoded corpus (make_base.sh tokenizer)")
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--window-tokens", type=int, default=256)
    ap.add_argument("--group", action="append", default=[], help="layers removed together, e.g. 2-5,8-11 (repeatable)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    model, windows = target_and_heldout(args.target, args.data, args.window_tokens, args.windows, args.threads)
    labels = windows[:, 1:]
    base_logits = _logits(model, windows)
    base_loss = F.cross_entropy(base_logits.flatten(0, 1), labels.flatten()).item()
    rows = []
    for layers in [[l] for l in range(model.config.num_hidden_layers)] + [list(parse_layers(g)) for g in args.group]:
        with ExitStack() as stack:
            for l in layers:
                stack.enter_context(skip_layer(model, l))
            rows.append({"layers": layers, **_compare(base_logits, _logits(model, windows), labels, base_loss)})
        r = rows[-1]
        print(f"{','.join(map(str, layers)):>24}  loss {r['loss_delta']:+.4f}  KL {r['kl']:.4f}  "
              f"top-1 changed {100 * r['top1_changed']:5.2f}%", flush=True)
    result = {"target": args.target, "windows": args.windows, "window_tokens": args.window_tokens,
              "base_loss": base_loss, "ablations": rows}
    print(json.dumps(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
