"""C(k) and the expert cost fit of an engine directory, profiled on TensorRT-LLM (GPU machines).

For each verify-length profile, TensorRT-LLM's debug knob
TLLM_SPEC_DECODE_FORCE_NUM_ACCEPTED_TOKENS makes every generation step accept
min(F, max_draft_len) draft tokens (`_apply_force_accepted_tokens`, called by the
dynamic-tree worker in eagle3_dynamic_tree.py @ 057c8a65145bb53caf3939ba4fbcabbad46ea3dc),
so a timed generation measures the cost of one iteration apart from the drafter's
quality. The knob is read from os.environ by `get_force_num_accepted_tokens(_float)`
(tensorrt_llm/_torch/speculative/interface.py @ 00b6d5a25c30b4382d24fbdf52956d601b3ffd24)
when the worker is built, in whichever process builds it. Hence:
- one GPU: TLLM_WORKER_USE_SINGLE_PROCESS=1 and the knob are set before the first LLM,
  so the worker is built in this process and sees it (an `MpiPoolSession` would spawn
  it through `MPIPoolExecutor(max_workers=..., path=sys.path)`, which passes no
  environment: tensorrt_llm/llmapi/mpi_session.py @ cc4777e94ddab84b0e2676f1dbcc91b86060329f);
- several GPUs: run under `mpirun -x TLLM_SPEC_DECODE_FORCE_NUM_ACCEPTED_TOKENS=F`, so every
  rank has the knob before it starts (`profiling_command`), rank 0 profiling through an
  `MpiCommSession` and the others serving it.
The knob is one value for all profiles (the largest max_draft_len): TensorRT-LLM caps it at
each profile's own max_draft_len. Whether it reached the worker is then checked on the
request's perf metrics (`speculative_decoding.total_accepted_draft_tokens`, requested with
`SamplingParams(return_perf_metrics=True)`: tensorrt_llm/sampling_params.py @
a98a9061d72f6fd39f5d055ebdd2c6878a100e2c) instead of assuming it: iterations = tokens -
accepted drafts, each accepting max_draft_len except the context step and a cut last one.

C(0) is plain decoding; values between profiled lengths are interpolated linearly. The
expert fit C(k, U) = c0 + c_tok*k + c_exp*U that joint needs is fitted on the same points
with U(k) = the expected unique (layer, expert) pairs of k + 1 tokens under uniform routing
(L * E * (1 - (1 - top_k/E)^(k+1)), `core.cost.RooflineCostModel.expected_unique`), since
TensorRT-LLM does not report routing; the profile's `method` says so. The TensorRT-LLM
calls are confined to `_trtllm_measure`; the rest runs (and is tested) on CPU.
"""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, MutableMapping

import numpy as np
import yaml

from ...core.cost import CostTable, ExpertCostModel
from .config import COST_PROFILE_JSON, EngineSpec
from .presets import ModelPreset

FORCE_ACCEPT_ENV = "TLLM_SPEC_DECODE_FORCE_NUM_ACCEPTED_TOKENS"
SINGLE_PROCESS_ENV = "TLLM_WORKER_USE_SINGLE_PROCESS"


@dataclass(frozen=True)
class Timing:
    """One profiled configuration: a generate call timed, with its request's counters."""

    seconds: float  # median wall time of one generate call
    num_tokens: int  # tokens it generated
    accepted_draft_tokens: int  # perf metrics: speculative_decoding.total_accepted_draft_tokens

    @property
    def iterations(self) -> int:
        """Engine iterations: each emits 1 token plus the draft tokens it accepted."""
        return max(self.num_tokens - self.accepted_draft_tokens, 1)

    @property
    def seconds_per_iteration(self) -> float:
        return self.seconds / self.iterations


Measure = Callable[[dict, str, int, int], Timing]  # (llm options, checkpoint, num_tokens, repeats) -> Timing


def force_accept_value(spec: EngineSpec) -> str:
    """The knob for all profiles: the largest max_draft_len (TensorRT-LLM caps it per profile)."""
    return str(max(p.max_draft_len for p in spec.profiles))


def profiling_command(spec: EngineSpec, build_args: str) -> str:
    """The launch line a multi-GPU profile needs: every rank gets the knob from mpirun."""
    return (f"mpirun -n {spec.parallel.world_size} -x {FORCE_ACCEPT_ENV}={force_accept_value(spec)} "
            f"moespec build {build_args}")


def prepare_profiling_process(spec: EngineSpec, world_size: int, environ: MutableMapping[str, str] | None = None) -> str:
    """Make the forced acceptance reach the process that builds TensorRT-LLM's worker.

    Returns "single-process" or "mpi-ranks"; ValueError (saying how to launch) otherwise.
    """
    environ = os.environ if environ is None else environ
    value, ranks = force_accept_value(spec), spec.parallel.world_size
    if ranks == 1 and world_size == 1:
        if environ.get(SINGLE_PROCESS_ENV) not in (None, "1"):
            raise ValueError(f"{SINGLE_PROCESS_ENV}={environ[SINGLE_PROCESS_ENV]!r} would build TensorRT-LLM's worker "
                             f"in a spawned process that never sees {FORCE_ACCEPT_ENV}; unset it")
        environ[SINGLE_PROCESS_ENV] = "1"
        environ[FORCE_ACCEPT_ENV] = value
        return "single-process"
    if world_size != ranks or environ.get(FORCE_ACCEPT_ENV) != value:
        raise ValueError(f"profiling this engine needs its {ranks} ranks started with the forced acceptance set on "
                         f"each: {profiling_command(spec, '...')} (this process: {world_size} rank(s), "
                         f"{FORCE_ACCEPT_ENV}={environ.get(FORCE_ACCEPT_ENV)!r})")
    return "mpi-ranks"


def check_forced_acceptance(timing: Timing, max_draft_len: int) -> None:
    """RuntimeError unless every generation step accepted max_draft_len draft tokens.

    The context step accepts none and the last step may be cut by max_tokens, hence the
    allowance of two steps.
    """
    expected = max_draft_len * max(timing.iterations - 2, 0)
    if timing.accepted_draft_tokens < expected:
        raise RuntimeError(
            f"forced acceptance did not reach TensorRT-LLM's worker: {timing.accepted_draft_tokens} draft tokens "
            f"accepted over {timing.iterations} iterations, expected >= {expected} ({FORCE_ACCEPT_ENV} "
            f"must be set where the worker is built)")


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


def expected_unique_experts(preset: ModelPreset, num_tokens: int) -> float:
    """Unique (layer, expert) pairs of num_tokens tokens under independent uniform routing."""
    e, top = preset.num_experts, preset.experts_per_token
    return preset.num_layers * e * (1.0 - (1.0 - top / e) ** num_tokens)


def fit_expert_costs(points: dict[int, float], preset: ModelPreset) -> ExpertCostModel:
    """C(k, U) = c0 + c_tok*k + c_exp*U on the profiled points, U(k) from uniform routing (k drafts + root).

    Three or more lengths: least squares (core.cost.ExpertCostModel.fit). Two (C(0) and one profile):
    too few for three constants, so the whole increase goes to experts (c_tok = 0), as in the
    bandwidth-bound regime of MoE decoding (core.cost.RooflineCostModel.expert_model).
    """
    ks = sorted(points)
    if len(ks) < 2:
        raise ValueError(f"need at least two profiled lengths to fit the expert cost model, got {ks}")
    unique = [expected_unique_experts(preset, k + 1) for k in ks]
    seconds = [points[k] for k in ks]
    if len(ks) >= 3:
        return ExpertCostModel.fit(np.array(ks, dtype=float), np.array(unique), np.array(seconds))
    c_exp = max((seconds[1] - seconds[0]) / (unique[1] - unique[0]), 0.0)
    c0 = max(seconds[0] - c_exp * unique[0], 1e-9)
    residual = [s - (c0 + c_exp * u) for s, u in zip(seconds, unique)]
    return ExpertCostModel(c0, 0.0, c_exp, float(math.sqrt(sum(r * r for r in residual) / 2)), 2)


def _trtllm_measure(options: dict, checkpoint: str, num_tokens: int, repeats: int,
                    mpi_session: Any = None) -> Timing:  # GPU machines only
    from tensorrt_llm import LLM, SamplingParams
    from tensorrt_llm.llmapi.llm_utils import update_llm_args_with_extra_dict

    from .version import check_effective_draft_tokens

    if (options.get("speculative_config") or {}).get("use_dynamic_tree"):
        from .config import with_batch_contract
        from .worker import installed_batch_contract

        options = with_batch_contract(options, installed_batch_contract())
    args = update_llm_args_with_extra_dict({"model": checkpoint}, options)
    if mpi_session is not None:
        args["_mpi_session"] = mpi_session
    llm = LLM(**args)
    try:
        spec = options.get("speculative_config")
        if spec is not None:
            check_effective_draft_tokens(llm.args.speculative_config, spec["max_total_draft_tokens"],
                                         spec["max_draft_len"])
        params = SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True, return_perf_metrics=True)
        llm.generate(["warm up"], params)
        times, outputs = [], None
        for _ in range(repeats):
            start = time.perf_counter()
            outputs = llm.generate(["Profile the cost of one speculative iteration."], params)
            times.append(time.perf_counter() - start)
    finally:
        llm.shutdown()
    completion = outputs[0].outputs[0]
    metrics = getattr(getattr(completion, "request_perf_metrics", None), "speculative_decoding", None)
    accepted = int(getattr(metrics, "total_accepted_draft_tokens", 0) or 0)
    return Timing(statistics.median(times), len(completion.token_ids), accepted)


def profile_points(spec: EngineSpec, engine_dir: Path, measure: Measure, num_tokens: int, repeats: int
                   ) -> dict[int, float]:
    """Seconds per iteration at k = 0 (plain) and at each profile's verify length, acceptance checked."""
    main = yaml.safe_load((engine_dir / spec.llm_api_options).read_text())
    plain = {k: v for k, v in main.items() if k != "speculative_config"}
    points = {0: measure(plain, spec.checkpoint, num_tokens, repeats).seconds_per_iteration}
    for p in spec.profiles:
        timing = measure(yaml.safe_load((engine_dir / p.options_yaml).read_text()), spec.checkpoint, num_tokens,
                         repeats)
        check_forced_acceptance(timing, p.max_draft_len)
        points[p.verify_length] = timing.seconds_per_iteration
    return points


def profile_engine(spec: EngineSpec, engine_dir: Path, num_tokens: int = 256, repeats: int = 3, *,
                   measure: Measure | None = None, version: str | None = None, device: str | None = None,
                   world_size: int = 1, environ: MutableMapping[str, str] | None = None) -> EngineSpec:
    """Measure C(k) and fit C(k, U) for every profile, write cost_profile.json, return the updated spec.

    measure/version/device default to the installed TensorRT-LLM and GPU.
    """
    prepare_profiling_process(spec, world_size, environ)
    if version is None:
        from .version import check_installed

        version = check_installed(spec.mode)
    if measure is None:
        measure = _trtllm_measure
    if device is None:
        import torch

        device = torch.cuda.get_device_name()
    points = profile_points(spec, engine_dir, measure, num_tokens, repeats)
    fit = fit_expert_costs(points, spec.model)
    max_nodes = max(p.verify_length for p in spec.profiles)
    table = CostTable(
        costs=interpolate_costs(points, max_nodes),
        model_id=spec.model.name,
        device=device,
        dtype=spec.dtype,
        tree=(spec.tree.steps, spec.tree.topk, spec.tree.max_draft_tokens),
        method=f"TensorRT-LLM {version}, forced acceptance (checked on perf metrics), batch 1, {num_tokens} tokens, "
               f"median of {repeats}; measured at k={sorted(points)}, linear in between; expert fit with U(k) from "
               "uniform routing of k + 1 tokens (routing is not measured on TensorRT-LLM)",
        expert_model=fit,
        plain_step=points[0],
    )
    table.save(engine_dir / COST_PROFILE_JSON)
    versions = {**spec.versions, "tensorrt_llm": version}
    return dataclasses.replace(spec, cost_profile=COST_PROFILE_JSON, versions=versions, dry_run=False)
