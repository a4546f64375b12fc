"""Measurements of the GPU check (`benchmarks/gpu_check.sh` runs this after the CUDA tests).

1. `moespec::select_tree` timings per mode on the device (64-node trees, 48 x 128 experts).
2. AR tokens/s on moespec-tiny: our engine (lean forward) vs transformers `generate` (eager).
3. ar and eagle3 tokens/s of the engine on moespec-tiny with CUDA graphs on vs off (interleaved),
   and whether both produce the same greedy tokens.
4. C(k), k in {0, 1, 2, 4, 8, 16, 32}: one verify forward of k draft nodes + root after a
   512-token prefix, eager and replayed from the verify-length bucket's CUDA graph, on a
   random-weight model with Qwen3-30B-A3B's shapes (bf16, 48 layers, 128 experts, top-8).
`--cpu-smoke`: tiny shapes and few repeats on the CPU, graphs replaced by the static-shape
forward they capture (`StaticVerify`), so CI runs every line of this script.

    python -m benchmarks.gpu_check --out DIR [--cpu-smoke]
Writes DIR/gpu_check.json and prints a summary.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

K_VALUES = (0, 1, 2, 4, 8, 16, 32)
QWEN3_30B_A3B = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                     num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                     num_experts=128, num_experts_per_tok=8, max_position_embeddings=4096)
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
            max_position_embeddings=1024)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_ms(fn, device: torch.device, repeats: int) -> float:
    fn()
    _sync(device)
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def select_timings(device: torch.device, repeats: int) -> list[dict]:
    from benchmarks.bench_select_kernels import BUDGET, C0, C_EXP, C_TOK, EPS, MODES, make_inputs
    from trtllm_moespec.kernels import select_tree

    rows = []
    for batch in (1, 8):
        inputs = tuple(t.to(device) for t in make_inputs(batch))
        for mode in MODES:
            run = lambda: select_tree(*inputs, mode=mode, budget=BUDGET, c0=C0, c_tok=C_TOK, c_exp=C_EXP, eps=EPS)  # noqa: E731
            rows.append(dict(mode=mode, batch=batch, ms=_median_ms(run, device, repeats)))
    return rows


def ar_tokens_per_s(device: torch.device, tokens: int, repeats: int) -> dict:
    from trtllm_moespec import LLM, SamplingParams

    llm = LLM("moespec-tiny", policy="ar", device=str(device))
    hf = llm.target.model
    ids = llm.encode(["def fibonacci(n):\n"])[0]
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)

    def generate() -> float:
        t0 = time.perf_counter()
        hf.generate(torch.tensor([ids], device=device), max_new_tokens=tokens, min_new_tokens=tokens,
                    do_sample=False, pad_token_id=0)
        _sync(device)
        return tokens / (time.perf_counter() - t0)
    llm.generate([ids], params)
    generate()
    ours, theirs = [], []
    for _ in range(repeats):  # interleaved
        ours.append(llm.generate([ids], params)[0].stats.tokens_per_s)
        theirs.append(generate())
    lean, ref = statistics.median(ours), statistics.median(theirs)
    return dict(lean_tokens_per_s=lean, transformers_generate_tokens_per_s=ref, ratio=lean / ref)


def graph_speed(device: torch.device, tokens: int, repeats: int) -> list[dict]:
    """Engine tokens/s with the verify forward replayed from CUDA graphs vs eager, per policy,
    interleaved; on the CPU smoke run the "graphs" side is the static-shape forward they capture."""
    from trtllm_moespec import LLM, SamplingParams
    from trtllm_moespec.models.cuda_graphs import verify_buckets

    rows = []
    for policy in ("ar", "eagle3"):
        on = LLM("moespec-tiny", policy=policy, device=str(device), cuda_graphs=device.type == "cuda",
                 override_profile=True)
        if device.type != "cuda":
            on.target.use_verify_runner("static", verify_buckets(on.tree.max_draft_tokens))
        off = LLM("moespec-tiny", policy=policy, device=str(device), cuda_graphs=False, override_profile=True)
        ids = on.encode(["def fibonacci(n):\n"])[0]
        params = SamplingParams(max_tokens=tokens, ignore_eos=True)
        first = {name: llm.generate([ids], params)[0].token_ids for name, llm in (("on", on), ("off", off))}
        speed = {"on": [], "off": []}
        for _ in range(repeats):  # interleaved
            for name, llm in (("on", on), ("off", off)):
                speed[name].append(llm.generate([ids], params)[0].stats.tokens_per_s)
        rows.append(dict(policy=policy, graphs_tokens_per_s=statistics.median(speed["on"]),
                         eager_tokens_per_s=statistics.median(speed["off"]), same_tokens=first["on"] == first["off"],
                         runner=on.target.verify_runner))
    return rows


def cost_table(device: torch.device, shapes: dict, prefix: int, repeats: int) -> dict:
    """C(k) eager and with CUDA graphs (CPU smoke: the static-shape forward instead of replay)."""
    import transformers

    from trtllm_moespec.core.layout import build_layout
    from trtllm_moespec.core.tree import DraftTree
    from trtllm_moespec.models.target import TargetModel

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = transformers.Qwen3MoeConfig(**shapes, tie_word_embeddings=False)
    t0 = time.perf_counter()
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # parameters are created in bf16 directly: no fp32 copy of 30B weights
    try:
        with torch.device(device):
            model = transformers.Qwen3MoeForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(previous)
    build_s = time.perf_counter() - t0
    target = TargetModel(model, model_impl="lean")
    buckets = tuple(k + 1 for k in K_VALUES)
    cache = target.new_cache()
    target._pool.ensure_len(prefix + max(buckets) + 1)
    gen = torch.Generator().manual_seed(0)
    target.prefill(cache, torch.randint(0, shapes["vocab_size"], (1, prefix), generator=gen))
    from trtllm_moespec.models.cuda_graphs import StaticVerify, VerifyGraphs

    runner_cls = VerifyGraphs if device.type == "cuda" else StaticVerify
    graphs = runner_cls(target.lean, target._pool, cache.slot, buckets)
    prefix_t = torch.tensor([prefix], device=device)
    rows = []
    for k in K_VALUES:
        parents = torch.tensor([[(i - 1) // 2 if i else -1 for i in range(k)]])  # a binary tree of k nodes
        tree = DraftTree.from_parents(torch.randint(0, shapes["vocab_size"], (1, k), generator=gen), parents,
                                      torch.full((1, k), 0.5))
        layout = build_layout(tree, torch.arange(k)[None], torch.tensor([1]))
        ids, pos = layout.token_ids.to(device), layout.position_ids(prefix).to(device)
        mask = layout.tree_mask().to(device)

        def eager():
            target.verify(cache, layout)
            target.discard(cache)
        graphed = lambda: graphs.run(ids, pos, prefix_t, mask)  # noqa: E731
        rows.append(dict(k=k, eager_ms=_median_ms(eager, device, repeats), graph_ms=_median_ms(graphed, device, repeats)))
    return dict(shapes=shapes, dtype=str(dtype), prefix=prefix, build_s=build_s, graphs=device.type == "cuda", rows=rows)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU (CI)")
    args = ap.parse_args(argv)
    smoke = args.cpu_smoke
    if not smoke and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --cpu-smoke on a CPU machine")
    device = torch.device("cpu" if smoke else "cuda")
    torch.set_num_threads(1 if smoke else torch.get_num_threads())
    result = dict(device=torch.cuda.get_device_name() if not smoke else "cpu (smoke)", torch=torch.__version__,
                  cpu_smoke=smoke)
    result["select_tree"] = select_timings(device, repeats=2 if smoke else 50)
    result["ar"] = ar_tokens_per_s(device, tokens=8 if smoke else 128, repeats=1 if smoke else 3)
    result["graph_speed"] = graph_speed(device, tokens=8 if smoke else 128, repeats=1 if smoke else 3)
    result["cost"] = cost_table(device, TINY if smoke else QWEN3_30B_A3B, prefix=16 if smoke else 512,
                                repeats=2 if smoke else 20)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_check.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"gpu check on {result['device']} (torch {result['torch']})")
    for row in result["select_tree"]:
        print(f"  select_tree {row['mode']:8s} B={row['batch']}: {row['ms']:.3f} ms")
    ar = result["ar"]
    print(f"  moespec-tiny ar: lean {ar['lean_tokens_per_s']:.1f} tok/s, transformers generate "
          f"{ar['transformers_generate_tokens_per_s']:.1f} tok/s ({ar['ratio']:.2f}x)")
    for row in result["graph_speed"]:
        print(f"  moespec-tiny {row['policy']}: graphs {row['graphs_tokens_per_s']:.1f} tok/s, eager "
              f"{row['eager_tokens_per_s']:.1f} tok/s, same tokens: {row['same_tokens']} (runner {row['runner']})")
    cost = result["cost"]
    print(f"  C(k) after {cost['prefix']} tokens ({cost['dtype']}, model built in {cost['build_s']:.0f} s; "
          f"{'graphs' if cost['graphs'] else 'static forward, no graphs on CPU'}):")
    for row in cost["rows"]:
        print(f"    k={row['k']:2d}  eager {row['eager_ms']:8.2f} ms   graph {row['graph_ms']:8.2f} ms")
    return result


if __name__ == "__main__":
    main()
