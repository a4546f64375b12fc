"""Tree selection speed on the CPU: the core reference (torch/numpy, what the op runs
on CPU) vs the CUDA C++ logic built for the host (plugins/tree_select via ctypes).

Workload: 64-node draft trees, 48 MoE layers x 128 experts (96 bitset words), top-8
experts per layer with skewed routing, modes evict / ecospec / joint, B = 1 and 8.
Prints a readable table, then one JSON line; writes benchmarks/results/select_kernels_cpu.json.
GPU timings (Triton, CUDA) need a GPU machine: this script only times the CPU paths.

  python benchmarks/bench_select_kernels.py [--repeats 50] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from trtllm_moespec.core import DraftTree, ExpertSets
from trtllm_moespec.kernels import select_tree_reference
from trtllm_moespec.kernels.host_lib import HostTreeSelect, build_host_library

NUM_NODES, NUM_LAYERS, NUM_EXPERTS, TOPK = 64, 48, 128, 8
MODES = ("evict", "ecospec", "joint")
BUDGET = 32
C0, C_TOK, C_EXP, EPS = 20e-3, 0.15e-3, 0.02e-3, 1e-3


def make_inputs(batch: int, seed: int = 0) -> tuple:
    """Random 64-node trees (any shape), skewed per-layer routing, a linear-ish cost table."""
    rng = np.random.default_rng(seed)
    parents = np.stack([[-1 if i == 0 else int(rng.integers(-1, min(i, 16))) for i in range(NUM_NODES)]
                        for _ in range(batch)])
    q = rng.beta(2.0, 2.0, size=(batch, NUM_NODES)).clip(1e-3, 1.0)
    tree = DraftTree.from_parents(torch.zeros(batch, NUM_NODES, dtype=torch.int64), torch.from_numpy(parents),
                                  torch.from_numpy(q).float())
    popularity = 1.0 / np.arange(1, NUM_EXPERTS + 1) ** 1.1
    popularity /= popularity.sum()
    ids = np.stack([[[rng.choice(NUM_EXPERTS, TOPK, replace=False, p=popularity) for _ in range(NUM_LAYERS)]
                     for _ in range(NUM_NODES)] for _ in range(batch)])
    bits = ExpertSets.from_topk_ids(torch.from_numpy(ids), NUM_EXPERTS).bits
    root_ids = np.stack([[rng.choice(NUM_EXPERTS, TOPK, replace=False, p=popularity) for _ in range(NUM_LAYERS)]
                         for _ in range(batch)])
    root = ExpertSets.from_topk_ids(torch.from_numpy(root_ids)[:, None], NUM_EXPERTS).bits[:, 0]
    table = torch.tensor([C0 + C_TOK * k + 2e-3 * np.sqrt(k) for k in range(BUDGET + 1)], dtype=torch.float64)
    return tree.scores, tree.parents, tree.valid, tree.depth, bits, root, table


def time_us(fn, repeats: int) -> float:
    """Median wall time of fn() in microseconds (after one warm-up call)."""
    fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "select_kernels_cpu.json")
    args = ap.parse_args()
    host = HostTreeSelect(build_host_library(tempfile.mkdtemp(prefix="moespec_host_")))
    kw = dict(budget=BUDGET, c0=C0, c_tok=C_TOK, c_exp=C_EXP, eps=EPS)
    rows = []
    for batch in (1, 8):
        inputs = make_inputs(batch)
        for mode in MODES:
            ref = select_tree_reference(*inputs, mode=mode, **kw)
            got = host.select(*inputs, mode=mode, **kw)
            assert torch.equal(ref.node_idx, got.node_idx), f"host != reference for {mode}"
            ref_us = time_us(lambda: select_tree_reference(*inputs, mode=mode, **kw), args.repeats)
            host_us = time_us(lambda: host.select(*inputs, mode=mode, **kw), args.repeats)
            raw_call, _ = host.bind(*inputs, mode=mode, **kw)
            raw_us = time_us(raw_call, args.repeats)
            rows.append(dict(mode=mode, batch=batch, reference_us_per_request=ref_us / batch,
                             host_cpp_us_per_request=host_us / batch, host_cpp_raw_us_per_request=raw_us / batch,
                             speedup=ref_us / host_us, speedup_raw=ref_us / raw_us,
                             mean_selected=float(ref.num_selected.double().mean())))
    print(f"tree selection on CPU: {NUM_NODES}-node trees, {NUM_LAYERS} layers x {NUM_EXPERTS} experts "
          f"(top-{TOPK}), budget {BUDGET}, median of {args.repeats}")
    print("C++ host = through the Python wrapper (checks + conversions + ctypes); raw = the C call alone")
    print(f"{'mode':<8} {'B':>3} {'reference us/req':>17} {'C++ host us/req':>16} {'C++ raw us/req':>15} "
          f"{'speedup raw':>12} {'selected':>9}")
    for r in rows:
        print(f"{r['mode']:<8} {r['batch']:>3} {r['reference_us_per_request']:>17.1f} "
              f"{r['host_cpp_us_per_request']:>16.1f} {r['host_cpp_raw_us_per_request']:>15.1f} "
              f"{r['speedup_raw']:>11.1f}x {r['mean_selected']:>9.1f}")
    result = dict(benchmark="select_kernels_cpu", num_nodes=NUM_NODES, num_layers=NUM_LAYERS, num_experts=NUM_EXPERTS,
                  topk=TOPK, budget=BUDGET, repeats=args.repeats, torch=torch.__version__,
                  machine=platform.machine(), processor=platform.processor() or platform.machine(),
                  gpu_timings="not measured (no GPU in this session)", rows=rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
