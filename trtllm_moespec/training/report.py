"""The numbers the issue asks for, measured on the shipped artefacts.

Held-out loss / perplexity of the target (every held-out token, 512-token
windows), per-layer expert utilisation on the same tokens, the C(k) curve with
unique experts per layer (``grouped_mm`` and ``eager`` experts), predictor top-K
overlap accuracy and milliseconds per ``predict_tree`` call on a 32-node tree,
parameter counts and file sizes. Prints a readable summary, then one JSON line,
and writes the JSON to ``out``.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from trtllm_moespec.core.tree import DraftTree
from trtllm_moespec.models.predictor import ExpertPredictor, num_parameters
from trtllm_moespec.training.ablation import ablate
from trtllm_moespec.training.cost_probe import format_curve, measure_cost_curve
from trtllm_moespec.training.data import contiguous_windows, load_streams
from trtllm_moespec.training.routing import RouterTrace, max_entropy_bits, utilisation
from trtllm_moespec.training.train_predictor import RoutingTraces, evaluate


@torch.no_grad()
def heldout_pass(model: torch.nn.Module, windows: torch.Tensor, batch_size: int = 8) -> tuple[float, torch.Tensor]:
    """(mean next-token CE in nats, top-K experts [W, S, L, K]) over windows [W, S + 1]."""
    total, count, traces = 0.0, 0, []
    for chunk in windows.split(batch_size):
        with RouterTrace(model) as trace:
            logits = model(input_ids=chunk[:, :-1], use_cache=False).logits
            traces.append(trace.topk_ids(chunk.shape[0]))
        total += F.cross_entropy(logits.float().flatten(0, 1), chunk[:, 1:].flatten(), reduction="sum").item()
        count += chunk[:, 1:].numel()
    return total / count, torch.cat(traces)


def _tree_of(num_nodes: int, seed: int = 0) -> DraftTree:
    """An EAGLE-like random tree (a node's parent is one of the 8 previous nodes or the root)."""
    gen = torch.Generator().manual_seed(seed)
    parents = torch.tensor([-1] + [int(torch.randint(max(-1, i - 8), i, (1,), generator=gen)) for i in range(1, num_nodes)])
    ids = torch.randint(0, 4096, (1, num_nodes), generator=gen)
    return DraftTree.from_parents(ids, parents[None], torch.full((1, num_nodes), 0.5))


def predictor_ms(predictor: ExpertPredictor, context: torch.Tensor, num_nodes: int = 32, reps: int = 30) -> float:
    tree = _tree_of(num_nodes)
    predictor.predict_tree(context, tree)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        predictor.predict_tree(context, tree)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20


def build_report(target_dir: Path, predictor_dir: Path, data_dir: Path, out: Path, max_windows: int | None = None, reps: int = 7,
                 ablation_windows: int = 0) -> dict:
    streams = load_streams(data_dir)
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    cfg = model.config
    start = time.time()
    loss, topk = heldout_pass(model, contiguous_windows(streams.heldout, 512, max_windows))
    util = utilisation(topk, cfg.num_experts)
    report = {
        "target_params": num_parameters(model),
        "target_mb": _mb(target_dir),
        "heldout_tokens": int(topk.shape[0] * topk.shape[1]),
        "heldout_loss": loss,
        "heldout_ppl": math.exp(loss),
        "heldout_bits_per_byte": loss / math.log(2) * len(streams.heldout) / streams.num_heldout_bytes,
        "entropy_bits_per_layer": util.entropy_bits.tolist(),
        "max_entropy_bits": max_entropy_bits(cfg.num_experts),
        "frac_experts_below_1pct_per_layer": util.frac_below_1pct.tolist(),
        "heldout_pass_s": time.time() - start,
    }
    if ablation_windows:  # every layer and expert changes the output (training/ablation.py)
        ablation = ablate(model, contiguous_windows(streams.heldout, 256, ablation_windows))
        report["ablation"] = ablation.summary() | {"windows": ablation_windows, "window_tokens": 256,
                                                   "layer_delta": ablation.layer_delta}
        print(f"ablation on {ablation_windows} x 256 held-out tokens: {ablation.summary()}")
    for impl in ("grouped_mm", "eager"):
        model.set_experts_implementation(impl)
        curve = measure_cost_curve(model, streams.heldout, reps=reps)
        report[f"cost_curve_{impl}"] = [asdict(p) for p in curve]
        print(f"C(k) with {impl} experts (fp32, {torch.get_num_threads()} threads, 200-token KV prefix):\n{format_curve(curve)}")
    if (predictor_dir / "config.json").is_file():
        predictor = ExpertPredictor.load(predictor_dir)
        predictor.check_target(cfg.num_hidden_layers, cfg.num_experts, cfg.num_experts_per_tok, cfg.vocab_size)
        S = predictor.config.max_seq_len
        W = topk.shape[0] * topk.shape[1] // S
        ids = contiguous_windows(streams.heldout, 512, max_windows)[:, :-1].reshape(-1)[: W * S].view(W, S)
        traces = RoutingTraces(ids, topk.reshape(-1, *topk.shape[2:])[: W * S].view(W, S, *topk.shape[2:]))
        p_loss, p_acc = evaluate(predictor, traces)
        report |= {
            "predictor_params": num_parameters(predictor.model),
            "predictor_mb": _mb(predictor_dir),
            "predictor_heldout_loss": p_loss,
            "predictor_topk_acc": p_acc,
            "predictor_ms_32_nodes": predictor_ms(predictor, torch.from_numpy(streams.heldout[:200].astype("int64"))),
        }
    print(
        f"target: {report['target_params'] / 1e6:.2f}M params, {report['target_mb']:.1f} MB; held-out loss {loss:.4f} nats/token, "
        f"ppl {report['heldout_ppl']:.2f}; expert entropy bits/layer {[round(e, 2) for e in report['entropy_bits_per_layer']]} "
        f"(max {report['max_entropy_bits']:.2f}); experts <1% tokens/layer {report['frac_experts_below_1pct_per_layer']}"
    )
    if "predictor_topk_acc" in report:
        print(f"predictor: {report['predictor_params'] / 1e6:.2f}M params, {report['predictor_mb']:.2f} MB, top-K acc {report['predictor_topk_acc']:.3f}, {report['predictor_ms_32_nodes']:.2f} ms per 32-node tree")
    print(json.dumps(report))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    return report
