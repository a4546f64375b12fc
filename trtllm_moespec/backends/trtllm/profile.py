"""C(k) profiling of an engine directory on TensorRT-LLM (GPU machines only).

For each verify-length profile, TensorRT-LLM's own debug knob
TLLM_SPEC_DECODE_FORCE_NUM_ACCEPTED_TOKENS (tensorrt_llm/_torch/speculative/
interface.py) forces every step to accept max_draft_len tokens, so a timed
generation of T tokens takes a known number of iterations and the cost per
iteration is measured apart from the drafter's quality. C(0) is plain decoding.
Values between the profiled verify lengths are interpolated linearly; the table
is written with core.cost.CostTable. The steps are timed with TensorRT-LLM's own
top-N pruning (the MoESpec worker is not installed while profiling), and each LLM is
checked to have kept the profile's draft sizes (version.check_effective_draft_tokens).
`interpolate_costs` is the only part that runs on CPU (and is tested there); the rest
has not run on this project's machines.
"""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
import time
from pathlib import Path
from typing import Any

import yaml

from ...core.cost import CostTable
from .config import COST_PROFILE_JSON, EngineSpec
from .version import check_effective_draft_tokens, check_installed

FORCE_ACCEPT_ENV = "TLLM_SPEC_DECODE_FORCE_NUM_ACCEPTED_TOKENS"


def interpolate_costs(points: dict[int, float], max_nodes: int) -> tuple[float, ...]:
    """C(0..max_nodes) by linear interpolation between measured (k, seconds) points.

    Needs points at k = 0 and k = max_nodes; raises ValueError otherwise.
    """
    if 0 not in points or max_nodes not in points:
        raise ValueError(f"need measurements at k=0 and k={max_nodes}, got {sorted(points)}")
    ks = sorted(points)
    costs = []
    for k in range(max_nodes + 1):
        hi = next(x for x in ks if x >= k)
        lo = max(x for x in ks if x <= k)
        t = 0.0 if hi == lo else (k - lo) / (hi - lo)
        costs.append(points[lo] + t * (points[hi] - points[lo]))
    return tuple(costs)


def _seconds_per_iteration(options: dict[str, Any], checkpoint: str, tokens_per_iteration: int,
                           num_tokens: int, repeats: int) -> float:
    from tensorrt_llm import LLM, SamplingParams
    from tensorrt_llm.llmapi.llm_utils import update_llm_args_with_extra_dict

    llm = LLM(**update_llm_args_with_extra_dict({"model": checkpoint}, options))
    try:
        spec = options.get("speculative_config")
        if spec is not None:
            check_effective_draft_tokens(llm.args.speculative_config, spec["max_total_draft_tokens"],
                                         spec["max_draft_len"])
        params = SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True)
        llm.generate(["warm up"], params)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            llm.generate(["Profile the cost of one speculative iteration."], params)
            times.append(time.perf_counter() - start)
    finally:
        llm.shutdown()
    return statistics.median(times) / math.ceil(num_tokens / tokens_per_iteration)


def profile_engine(spec: EngineSpec, engine_dir: Path, num_tokens: int = 256, repeats: int = 3) -> EngineSpec:
    """Measure C(k) for every profile, write cost_profile.json, return the updated spec."""
    import torch

    version = check_installed(spec.mode)
    main = yaml.safe_load((engine_dir / spec.llm_api_options).read_text())
    plain = {k: v for k, v in main.items() if k != "speculative_config"}
    points = {0: _seconds_per_iteration(plain, spec.checkpoint, 1, num_tokens, repeats)}
    for p in spec.profiles:
        options = yaml.safe_load((engine_dir / p.options_yaml).read_text())
        os.environ[FORCE_ACCEPT_ENV] = str(p.max_draft_len)
        try:
            points[p.verify_length] = _seconds_per_iteration(
                options, spec.checkpoint, p.max_draft_len + 1, num_tokens, repeats)
        finally:
            os.environ.pop(FORCE_ACCEPT_ENV, None)
    max_nodes = max(p.verify_length for p in spec.profiles)
    table = CostTable(
        costs=interpolate_costs(points, max_nodes),
        model_id=spec.model.name,
        device=torch.cuda.get_device_name(),
        dtype=spec.dtype,
        tree=(spec.tree.steps, spec.tree.topk, spec.tree.max_draft_tokens),
        method=f"TensorRT-LLM {version}, forced acceptance, batch 1, {num_tokens} tokens, median of {repeats}; "
               f"measured at k={sorted(points)}, linear in between",
    )
    table.save(engine_dir / COST_PROFILE_JSON)
    versions = {**spec.versions, "tensorrt_llm": version}
    return dataclasses.replace(spec, cost_profile=COST_PROFILE_JSON, versions=versions, dry_run=False)
