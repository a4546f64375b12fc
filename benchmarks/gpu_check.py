"""Measurements of the GPU check (`benchmarks/gpu_check.sh` runs this after the CUDA tests).

1. `moespec::select_tree` timings per mode on the device (64-node trees, 48 x 128 experts).
2. AR tokens/s on moespec-tiny: our engine (lean forward) vs transformers `generate` (eager).
3. ar and eagle3 tokens/s of the engine on moespec-tiny with CUDA graphs on vs off (interleaved),
   and whether both produce the same greedy tokens; bf16 on the GPU, the dtype served models run in
   and the one torch's grouped GEMM has a device-only kernel for (in fp32 a verify's experts run as
   `models/moe.py`'s gathered matmul instead, since torch's reads the group offsets on the host).
4. C(k), k in {0, 1, 2, 4, 8, 16, 32}: one verify forward of k draft nodes + root after a
   512-token prefix, eager and replayed from the verify-length bucket's CUDA graph, on a
   random-weight model with Qwen3-30B-A3B's shapes (bf16, 48 layers, 128 experts, top-8).
5. Host syncs: per speculative step of eagle3 / evict / joint on moespec-tiny (graphs on, guard off),
   the device synchronisations before the target verify (CUDA's sync debug mode warns at each), and
   the source lines that caused them. The README claims one (the selected count and depth); a
   read-through found more (evict and joint: the calibrated values and the drafting stop rule).
6. Batch sweep on moespec-tiny: the batched engine (`engine.batch.BatchedEngine`, one target
   forward per step for the whole batch) at B = 1, 2, 4, 8 requests submitted together, for
   `ar`, `eagle3` and `joint-batch`: tokens/s (all requests' new tokens over the wall time),
   and per B whether every request's greedy tokens equal its single-request `ar` output.
   A time budget bounds it: batch sizes not started within it are listed as skipped.
`--cpu-smoke`: tiny shapes and few repeats on the CPU, graphs replaced by the static-shape
forward they capture (`StaticVerify`), so CI runs every line of this script.

    python -m benchmarks.gpu_check --out DIR [--cpu-smoke]
Writes DIR/gpu_check.json (after every section, so a timeout keeps what finished) and prints a
summary. A section that raises is recorded as {"error": ...} and the others still run. Exits 1
when a section failed or a batch-sweep request's greedy tokens differ from its single-request
`ar` output (the JSON and summary are written first).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import time
import traceback
import warnings
from pathlib import Path

import torch

K_VALUES = (0, 1, 2, 4, 8, 16, 32)
QWEN3_30B_A3B = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                     num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                     num_experts=128, num_experts_per_tok=8, max_position_embeddings=4096)
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
            max_position_embeddings=1024)
BATCH_SIZES = (1, 2, 4, 8)
BATCH_METHODS = ("ar", "eagle3", "joint-batch")  # X-batch: policy X's nodes chosen across the batch
# Distinct prompts, one per request slot (the first B serve batch size B), the same for every method.
BATCH_PROMPTS = ("def fibonacci(n):\n", "class Stack:\n    def push(self, x):\n", "import numpy as np\n\ndef mean(",
                 "for i in range(10):\n    print(", "# sort a list of numbers\ndef sort(xs):\n",
                 "def is_prime(n: int) -> bool:\n", "with open(path) as f:\n    for line in f:\n",
                 "def merge(a, b):\n    out = []\n")
SWEEP_MARGIN_S = 30.0  # the sweep starts no batch size later than this before the time limit
SYNC_POLICIES = ("eagle3", "evict", "joint")


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
    interleaved (bf16 on the GPU, see the module docstring); on the CPU smoke run the "graphs" side
    is the static-shape forward they capture."""
    from trtllm_moespec import LLM, SamplingParams
    from trtllm_moespec.models.cuda_graphs import verify_buckets

    dtype = "bfloat16" if device.type == "cuda" else "float32"
    rows = []
    for policy in ("ar", "eagle3"):
        on = LLM("moespec-tiny", policy=policy, device=str(device), dtype=dtype, cuda_graphs=device.type == "cuda",
                 override_profile=True)
        if device.type != "cuda":
            on.target.use_verify_runner("static", verify_buckets(on.tree.max_draft_tokens))
        off = LLM("moespec-tiny", policy=policy, device=str(device), dtype=dtype, cuda_graphs=False,
                  override_profile=True)
        ids = on.encode(["def fibonacci(n):\n"])[0]
        params = SamplingParams(max_tokens=tokens, ignore_eos=True)
        first = {name: llm.generate([ids], params)[0].token_ids for name, llm in (("on", on), ("off", off))}
        speed = {"on": [], "off": []}
        for _ in range(repeats):  # interleaved
            for name, llm in (("on", on), ("off", off)):
                speed[name].append(llm.generate([ids], params)[0].stats.tokens_per_s)
        rows.append(dict(policy=policy, dtype=dtype, graphs_tokens_per_s=statistics.median(speed["on"]),
                         eager_tokens_per_s=statistics.median(speed["off"]), same_tokens=first["on"] == first["off"],
                         runner=on.target.verify_runner))
    return rows


def _run_batch(engine, llm, prompts: list[list[int]], params) -> tuple[list[list[int]], float]:
    """All prompts submitted together to one batched engine, run to completion; each request's
    tokens and the batch's new tokens per second (wall time of the whole run)."""
    requests = [llm.make_request(ids, params) for ids in prompts]
    _sync(llm.target.device)
    t0 = time.perf_counter()
    engine.run_all(requests)
    _sync(llm.target.device)
    elapsed = time.perf_counter() - t0
    return [r.output_ids for r in requests], sum(len(r.output_ids) for r in requests) / elapsed


def batch_sweep(device: torch.device, tokens: int, repeats: int, budget_s: float,
                batch_sizes: tuple[int, ...] = BATCH_SIZES, methods: tuple[str, ...] = BATCH_METHODS) -> dict:
    """Batched-engine tokens/s per (B, method), methods interleaved per repeat, with the greedy
    exactness check: every request of every run equals its single-request `ar` output. Batch
    sizes not started within `budget_s` seconds are skipped (listed), so the script's time budget holds."""
    from trtllm_moespec import LLM, SamplingParams
    from trtllm_moespec.engine.batch import BatchedEngine

    if max(batch_sizes) > len(BATCH_PROMPTS):
        raise ValueError(f"batch sizes up to {len(BATCH_PROMPTS)} (one distinct prompt per request)")
    llms = {m: LLM("moespec-tiny", policy=m.removesuffix("-batch"), device=str(device)) for m in methods}
    ref_llm = llms["ar"] if "ar" in llms else LLM("moespec-tiny", policy="ar", device=str(device))
    prompts = [ref_llm.encode([p])[0] for p in BATCH_PROMPTS[:max(batch_sizes)]]
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)  # greedy, fixed length
    alone = [ref_llm.generate([ids], params)[0].token_ids for ids in prompts]
    rows: list[dict] = []
    skipped: list[int] = []
    t0 = time.perf_counter()
    for batch in batch_sizes:
        if time.perf_counter() - t0 > budget_s:
            skipped.append(batch)
            continue
        # One engine per (method, B), as a server with max batch size B; its first run warms it up
        # (joint-batch learns its per-batch-size costs and goodput guard online) and is checked too.
        engines = {m: BatchedEngine(llms[m].engine, batch, batch_policy=m if m.endswith("-batch") else None)
                   for m in methods}
        exact = {m: _run_batch(engines[m], llms[m], prompts[:batch], params)[0] == alone[:batch] for m in methods}
        speed: dict[str, list[float]] = {m: [] for m in methods}
        for _ in range(repeats):  # interleaved, so machine drift hits every method alike
            for m in methods:
                outputs, tokens_per_s = _run_batch(engines[m], llms[m], prompts[:batch], params)
                exact[m] = exact[m] and outputs == alone[:batch]
                speed[m].append(tokens_per_s)
        rows += [dict(batch=batch, method=m, tokens_per_s=statistics.median(speed[m]), exact=exact[m]) for m in methods]
    return dict(model="moespec-tiny", tokens=tokens, repeats=repeats, budget_s=budget_s, rows=rows,
                skipped_batch_sizes=skipped)


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


def _sync_debug(device: torch.device, mode: str) -> None:
    if device.type == "cuda":  # the mode exists on CUDA builds only (the CPU smoke counts nothing)
        torch.cuda.set_sync_debug_mode(mode)


def host_syncs(device: torch.device, tokens: int, policies: tuple[str, ...] = SYNC_POLICIES) -> list[dict]:
    """Per policy: device syncs in each speculative step before `target.verify`, and where they happen."""
    from trtllm_moespec import LLM, SamplingParams

    rows = []
    for policy in policies:
        llm = LLM("moespec-tiny", policy=policy, device=device.type, guard="off", override_profile=True)
        ids = llm.encode(["def fibonacci(n):\n"])[0]
        params = SamplingParams(max_tokens=tokens, ignore_eos=True)
        llm.generate([ids], params)  # graphs captured and tables built before counting
        engine, target = llm.engine, llm.target
        step, verify = engine._step, target.verify
        counts, places = [], collections.Counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")

            def counted_step(*args, **kwargs):
                caught.clear()
                _sync_debug(device, "warn")
                try:
                    return step(*args, **kwargs)
                finally:
                    _sync_debug(device, "default")

            def counted_verify(*args, **kwargs):
                syncs = [w for w in caught if "synchroniz" in str(w.message)]
                counts.append(len(syncs))
                places.update(f"{os.path.relpath(w.filename)}:{w.lineno}" for w in syncs)
                _sync_debug(device, "default")
                return verify(*args, **kwargs)

            engine._step, target.verify = counted_step, counted_verify  # instance attributes over the methods
            try:
                llm.generate([ids], params)
            finally:
                del engine._step, target.verify
        rows.append(dict(policy=policy, steps=len(counts), median=statistics.median(counts) if counts else None,
                         max=max(counts, default=None), places=places.most_common(12)))
    return rows


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU (CI)")
    ap.add_argument("--time-limit", type=float, default=float(os.environ.get("MEASURE_TIMEOUT", 180)),
                    help="seconds this run may take (gpu_check.sh's MEASURE_TIMEOUT): bounds the batch sweep")
    args = ap.parse_args(argv)
    start = time.perf_counter()
    smoke = args.cpu_smoke
    if not smoke and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --cpu-smoke on a CPU machine")
    device = torch.device("cpu" if smoke else "cuda")
    torch.set_num_threads(1 if smoke else torch.get_num_threads())
    result = dict(device=torch.cuda.get_device_name() if not smoke else "cpu (smoke)", torch=torch.__version__,
                  cpu_smoke=smoke)
    args.out.mkdir(parents=True, exist_ok=True)
    sections = (
        ("select_tree", lambda: select_timings(device, repeats=2 if smoke else 50)),
        ("ar", lambda: ar_tokens_per_s(device, tokens=8 if smoke else 128, repeats=1 if smoke else 3)),
        ("graph_speed", lambda: graph_speed(device, tokens=8 if smoke else 128, repeats=1 if smoke else 3)),
        ("cost", lambda: cost_table(device, TINY if smoke else QWEN3_30B_A3B, prefix=16 if smoke else 512,
                                    repeats=2 if smoke else 20)),
        ("host_syncs", lambda: host_syncs(device, tokens=6 if smoke else 24)),
        # Last, so a slow sweep cannot cost the sections above; few tokens and repeats, and a budget
        # (what is left of the time limit less a margin for the batch size under way, at most 60 s),
        # keep its 12 (B, method) cells inside the script's 6 minutes.
        ("batch_sweep", lambda: batch_sweep(device, tokens=6 if smoke else 32, repeats=1 if smoke else 2,
                                            budget_s=max(0.0, min(60.0, args.time_limit - SWEEP_MARGIN_S
                                                                  - (time.perf_counter() - start))))),
    )
    for name, run in sections:
        # A failing section is recorded and the others still run: one GPU session must bring back
        # everything that works, not stop at the first CUDA-only failure.
        t0 = time.perf_counter()
        try:
            result[name] = run()
        except Exception as exc:  # noqa: BLE001 (reported in the JSON and the summary, and exit status 1)
            traceback.print_exc()
            result[name] = dict(error=f"{type(exc).__name__}: {exc}")
        result.setdefault("section_s", {})[name] = time.perf_counter() - t0
        (args.out / "gpu_check.json").write_text(json.dumps(result, indent=2) + "\n")
    _print_summary(result)
    return result


def _print_select(rows: list[dict]) -> None:
    for row in rows:
        print(f"  select_tree {row['mode']:8s} B={row['batch']}: {row['ms']:.3f} ms")


def _print_ar(ar: dict) -> None:
    print(f"  moespec-tiny ar: lean {ar['lean_tokens_per_s']:.1f} tok/s, transformers generate "
          f"{ar['transformers_generate_tokens_per_s']:.1f} tok/s ({ar['ratio']:.2f}x)")


def _print_graph_speed(rows: list[dict]) -> None:
    for row in rows:
        print(f"  moespec-tiny {row['policy']} ({row['dtype']}): graphs {row['graphs_tokens_per_s']:.1f} tok/s, eager "
              f"{row['eager_tokens_per_s']:.1f} tok/s, same tokens: {row['same_tokens']} (runner {row['runner']})")


def _print_cost(cost: dict) -> None:
    print(f"  C(k) after {cost['prefix']} tokens ({cost['dtype']}, model built in {cost['build_s']:.0f} s; "
          f"{'graphs' if cost['graphs'] else 'static forward, no graphs on CPU'}):")
    for row in cost["rows"]:
        print(f"    k={row['k']:2d}  eager {row['eager_ms']:8.2f} ms   graph {row['graph_ms']:8.2f} ms")


def _print_batch_sweep(sweep: dict) -> None:
    print(f"  batch sweep, moespec-tiny, batched engine, {sweep['tokens']} new tokens per request "
          "(tokens/s; * = a request differs from its single-request ar output):")
    print("    " + "B".rjust(3) + "".join(m.rjust(14) for m in BATCH_METHODS))
    for batch in sorted({row["batch"] for row in sweep["rows"]}):
        cells = {row["method"]: row for row in sweep["rows"] if row["batch"] == batch}
        print("    " + str(batch).rjust(3) + "".join(
            (f"{cells[m]['tokens_per_s']:.1f}" + ("" if cells[m]["exact"] else "*")).rjust(14) for m in BATCH_METHODS))
    if sweep["skipped_batch_sizes"]:
        print(f"    skipped (time budget {sweep['budget_s']:.0f} s): B = {sweep['skipped_batch_sizes']}")


def _print_host_syncs(rows: list[dict]) -> None:
    for row in rows:
        print(f"  host syncs before the verify, {row['policy']}: median {row['median']}, max {row['max']} per step "
              f"({row['steps']} steps); most at " + ", ".join(f"{p} x{n}" for p, n in row["places"][:4]))


_PRINTERS = dict(select_tree=_print_select, ar=_print_ar, graph_speed=_print_graph_speed, cost=_print_cost,
                 batch_sweep=_print_batch_sweep, host_syncs=_print_host_syncs)


def _failed(section) -> bool:
    return isinstance(section, dict) and "error" in section


def _print_summary(result: dict) -> None:
    """The human-readable summary of `main`'s result (the JSON holds everything)."""
    print(f"gpu check on {result['device']} (torch {result['torch']})")
    for name, printer in _PRINTERS.items():
        if _failed(result[name]):
            print(f"  {name}: FAILED ({result[name]['error']})")
        else:
            printer(result[name])
    print("  section times: " + ", ".join(f"{k} {v:.0f} s" for k, v in result["section_s"].items()))


def passed(result: dict) -> bool:
    """Every section ran, and every batch-sweep request produced its single-request `ar` tokens."""
    if any(_failed(result[name]) for name in _PRINTERS):
        return False
    return all(row["exact"] for row in result["batch_sweep"]["rows"])


if __name__ == "__main__":
    if not passed(main()):
        print("gpu check: a section failed or the batched engine's greedy output differs from single-request ar "
              "(see gpu_check.json)")
        raise SystemExit(1)
