"""Per-step cost of each value model (values + online observe) on recorded steps, the models
interleaved step by step, one torch thread. Prints a summary, then one JSON line.

    python -m benchmarks.bench_values runs/replay/heldout_t0.safetensors [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
import torch


def measure(records_path: str, kinds=("raw", "calibrated", "head"), num_steps: int = 60, repeats: int = 2) -> dict:
    from trtllm_moespec.core.sampling import SamplingConfig
    from trtllm_moespec.models.target import TargetModel
    from trtllm_moespec.replay.records import ReplayFile
    from trtllm_moespec.replay.score import _Draft
    from trtllm_moespec.resolve import load_value_model, resolve_model

    records = ReplayFile.load(records_path)
    paths = resolve_model("moespec-tiny")
    target = TargetModel.load(paths.target)
    models = {k: load_value_model(k, paths, target) for k in kinds}
    steps = [records.step(s) for s in range(0, records.num_steps, max(records.num_steps // num_steps, 1))]
    times: dict[str, list[float]] = {k: [] for k in models}
    for _ in range(repeats):
        states = {k: m.for_request(SamplingConfig()) for k, m in models.items()}
        for step in steps:  # interleaved: machine drift hits every model alike
            for k, state in states.items():
                t = time.perf_counter()
                state.values(step.tree, _Draft(step.node_hidden), step.context)
                state.observe(step.tree, torch.tensor([list(range(8))]), torch.tensor([[0]]))
                times[k].append(time.perf_counter() - t)
    return {"steps": len(steps), "nodes_per_step": float(np.mean([s.tree.num_nodes for s in steps])),
            "load_average": os.getloadavg(),
            "value_model_ms_per_step": {k: {"median_ms": float(np.median(v)) * 1e3, "mean_ms": float(np.mean(v)) * 1e3}
                                        for k, v in times.items()}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("records")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    report = {"command": "python -m benchmarks.bench_values " + " ".join(argv or []), **measure(args.records)}
    for k, r in report["value_model_ms_per_step"].items():
        print(f"{k:>10}: median {r['median_ms']:.2f} ms, mean {r['mean_ms']:.2f} ms per step "
              f"(load average {report['load_average'][0]:.1f})")
    if args.json:
        with open(args.json, "w") as f:
            f.write(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    import sys

    raise SystemExit(main(sys.argv[1:]))
