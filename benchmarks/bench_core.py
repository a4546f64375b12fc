"""Per-request speed of the core on this CPU: selection policies and verification.

Targets (issue: core library): for a 64-node tree and 48 layers x 128 experts,
evict <= 0.2 ms, ecospec / joint <= 2 ms; verifying a 32-node tree over a 150k
vocabulary <= 5 ms at temperature 1. Prints a summary, then one JSON line.

    python -m benchmarks.bench_core [--repeats 200] [--json benchmarks/results/core_cpu.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform

import numpy as np
import torch

from benchmarks.bench_select_kernels import time_us
from trtllm_moespec.core import (CostTable, ExpertCostModel, ExpertSets, SamplingConfig, build_layout, draft_root,
                                 grow_tree, make_policy, top_k_nodes, verify_tree)


def _eagle_tree(rng, steps: int, topk: int, vocab: int = 1000):
    def step(shape):
        p = rng.dirichlet(np.ones(vocab) * 0.1, size=shape)
        ids = np.argsort(-p, -1)[..., :topk]
        return torch.from_numpy(ids), torch.from_numpy(np.take_along_axis(p, ids, -1)).float()

    tree, frontier = draft_root(*step((1,)))
    for _ in range(steps - 1):
        tree, frontier = grow_tree(tree, frontier, *step((1, topk)), topk)
    return tree


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--json", default=None, help="also write the results to this file")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    tree = _eagle_tree(rng, steps=5, topk=4)  # 4 + 4 * 16 = 68 nodes (the "64-node tree")
    L, E, K = 48, 128, 8
    ids = torch.from_numpy(np.stack([[rng.choice(E, K, replace=False) for _ in range(L)] for _ in range(tree.num_nodes)]))[None]
    experts = ExpertSets.from_topk_ids(ids, E)
    root = experts.bits[:, 0].clone()
    table = CostTable(tuple(1.0 + 0.05 * k for k in range(65)))
    policies = {
        "evict": make_policy("evict", cost_table=table, budget=64),
        "ecospec": make_policy("ecospec", budget=32),
        "joint": make_policy("joint", cost_model=ExpertCostModel(1.0, 0.01, 0.002), budget=64),
        "eagle3": make_policy("eagle3", budget=32),
    }
    results = {f"{name}_ms": time_us(lambda p=p: p.select(tree, experts, root), args.repeats) / 1e3 for name, p in policies.items()}

    vocab = 150_000
    tree32 = _eagle_tree(rng, steps=4, topk=4)
    layout = build_layout(tree32, top_k_nodes(tree32, 32), torch.tensor([0]))
    logits = torch.randn(1, layout.num_positions, vocab)
    gens = [torch.Generator().manual_seed(0)]
    for temp in (0.0, 1.0):
        cfg = [SamplingConfig(temperature=temp)]
        results[f"verify32_v150k_T{temp:g}_ms"] = time_us(lambda c=cfg: verify_tree(layout, logits, c, gens), max(20, args.repeats // 10)) / 1e3
    results.update(num_nodes=tree.num_nodes, load_average=os.getloadavg()[0], layers=L, experts=E, machine=platform.processor() or platform.machine(),
                   torch=torch.__version__, threads=torch.get_num_threads())
    print("core speed on this CPU (median ms per request):")
    for k, v in results.items():
        if k.endswith("_ms"):
            print(f"  {k:28s} {v:8.3f}")
    print(json.dumps(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    main()
