"""Multi-process entry point: `mpirun -n N python -m trtllm_moespec.runtime.launch --engine-dir E ...`.

With tensorrt_llm importable, every rank first installs the MoESpec worker
(backends/trtllm/reach.py: a patch made on rank 0 does not reach the others); then
rank 0 builds the Executor on TensorRT-LLM with an MPI session over COMM_WORLD (the
tensor/expert-parallel sizes come from the engine directory; the world size must
equal tp * pp) and the other ranks serve `MPICommExecutor`, as TensorRT-LLM's own
llmapi Triton model did on the 1.2 line (triton_backend/all_models/llmapi/tensorrt_llm/1/model.py @
b35ac1b64368513d215c57d2ed01d62d910df8da). Without tensorrt_llm, one process runs our PyTorch engine; under
mpirun the ranks run it expert-parallel (`trtllm_moespec.parallel`: the world size must
equal the engine's ep; rank 0 drafts and selects, every rank runs the verify forward).
`--plan-only` prints what each rank would do (with TensorRT-LLM: after installing,
which worker class its `get_spec_worker` would build for the main profile) and exits.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from ..backends.trtllm.config import EngineSpec, load_engine_spec
from ..backends.trtllm.reach import leader_mpi_session, mpi_rank_and_size, serve_mpi_worker
from ..backends.trtllm.version import trtllm_available
from .executor import choose_backend


@dataclass(frozen=True)
class LaunchPlan:
    backend: str  # "tensorrt_llm" | "pytorch"
    role: str  # "leader" (runs generate), "worker" (serves the leader), "exit" (nothing to do)
    message: str  # one line saying what this rank does


def launch_plan(spec: EngineSpec, rank: int, world_size: int, backend: str) -> LaunchPlan:
    """What `rank` of `world_size` does for an engine on `backend` (already chosen)."""
    tp, pp = spec.parallel.tp, spec.parallel.pp
    if backend == "tensorrt_llm":
        if world_size > 1 and world_size != tp * pp:
            raise ValueError(f"mpirun started {world_size} ranks but the engine needs tp*pp = {tp}*{pp} = {tp * pp}")
        role = "leader" if rank == 0 else "worker"
        return LaunchPlan(backend, role, f"rank {rank}/{world_size}: TensorRT-LLM {role} (tp={tp}, ep={spec.parallel.ep})")
    if world_size == 1:
        return LaunchPlan(backend, "leader", "rank 0/1: tensorrt_llm not available, running the PyTorch engine in this process")
    ep = spec.parallel.ep
    if world_size != ep:
        raise ValueError(f"mpirun started {world_size} ranks but the engine's expert parallelism is ep={ep}: they must "
                         "match for the PyTorch engine")
    role = "leader" if rank == 0 else "ep_worker"
    what = "drafts, selects and verifies" if rank == 0 else "serves rank 0's verify forwards"
    return LaunchPlan(backend, role, f"rank {rank}/{world_size}: tensorrt_llm not available, PyTorch engine with expert "
                      f"parallelism ep={ep}: this rank holds 1/{ep} of every MoE layer's experts and {what}")


def add_launch_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--engine-dir", required=True)
    parser.add_argument("--prompt", action="append", required=True, help="repeat for several prompts")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backend", default="auto", choices=("auto", "tensorrt_llm", "pytorch"))
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--plan-only", action="store_true", help="print what each rank does and exit")
    return parser


def install_on_rank(spec: EngineSpec, engine_dir: str, rank: int) -> str:
    """Install the worker in this rank's process; returns the worker class it would build (one line)."""
    import yaml

    from ..backends.trtllm.reach import PlannedSpecConfig, install_for_engine

    record = install_for_engine(spec, engine_dir)
    if record is None:
        return f"rank {rank}: worker class TensorRT-LLM linear EAGLE-3 worker (chain mode)"
    from ..backends.trtllm.worker import installed_worker_name

    options = yaml.safe_load((Path(engine_dir) / spec.llm_api_options).read_text())
    return f"rank {rank}: worker class {installed_worker_name(PlannedSpecConfig(options))}"


def _run_leader(args: argparse.Namespace, backend: str, world_size: int, ep=None) -> int:
    from .. import SamplingParams
    from .executor import Executor

    session = leader_mpi_session(world_size) if backend == "tensorrt_llm" else None
    executor = Executor(args.engine_dir, backend, device=args.device, dtype=args.dtype, mpi_session=session,
                        world_size=world_size, ep=ep)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed)
    try:
        outputs = executor.generate(args.prompt, params)
    finally:
        executor.shutdown()
    for prompt, out in zip(args.prompt, outputs):
        print(f"--- {prompt!r}\n{out.text}")
    stats = [{k: getattr(o.stats, k, None) for k in ("mean_accepted_tokens", "verified_tokens")} for o in outputs]
    print(json.dumps({"backend": backend, "engine_dir": str(args.engine_dir), "stats": stats}))
    return 0


def _run_pytorch_ep(args: argparse.Namespace, spec: EngineSpec, world_size: int) -> int:
    """Every rank: the PyTorch engine split over the MPI world by experts (trtllm_moespec.parallel)."""
    from ..parallel.run import check_launch, run_expert_parallel

    if spec.checkpoint is None:
        raise ValueError(f"{args.engine_dir}/moespec.json has no target checkpoint; rebuild with --checkpoint")
    check_launch(world_size, spec.checkpoint)
    return run_expert_parallel(args.device or "cpu", 1, lambda ctx: _run_leader(args, "pytorch", world_size, ep=ctx))


def main(argv: Sequence[str] | None = None) -> int:
    args = add_launch_arguments(argparse.ArgumentParser(prog="python -m trtllm_moespec.runtime.launch")).parse_args(argv)
    rank, world_size = mpi_rank_and_size()
    try:
        spec = load_engine_spec(args.engine_dir)
        backend = choose_backend(args.backend, trtllm_available())
        plan = launch_plan(spec, rank, world_size, backend)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"rank {rank}: error: {e}", file=sys.stderr)
        return 2
    print(plan.message, file=sys.stderr if plan.role == "exit" else sys.stdout, flush=True)
    if plan.role == "exit":
        return 0
    if backend == "tensorrt_llm" and (args.plan_only or plan.role == "worker"):
        try:
            print(install_on_rank(spec, args.engine_dir, rank), flush=True)
        except (ValueError, RuntimeError) as e:
            print(f"rank {rank}: error: {e}", file=sys.stderr)
            return 2
    if args.plan_only:
        return 0
    if backend == "pytorch" and world_size > 1:
        try:
            return _run_pytorch_ep(args, spec, world_size)
        except (ValueError, FileNotFoundError) as e:
            print(f"rank {rank}: error: {e}", file=sys.stderr)
            return 2
    if plan.role == "worker":
        serve_mpi_worker()
        return 0
    return _run_leader(args, backend, world_size)


if __name__ == "__main__":
    sys.exit(main())
