"""Making the worker patch reach every process that builds the model.

`install()` patches modules of the process it runs in. TensorRT-LLM builds the model
elsewhere unless told otherwise (tensorrt_llm/executor/executor.py @
ed53795b33fc139493f762a1c6c53f691cf52d38, `GenerationExecutor.create`): with one GPU it
spawns a worker process through mpi4py unless `TLLM_WORKER_USE_SINGLE_PROCESS` is set,
and with a model world size above 1 and no mpirun it spawns MPI workers; under mpirun
with an `MpiCommSession`, rank 0 runs its part in-process and the other ranks run theirs
through `MPICommExecutor`. Spawned workers run the function the executor proxy submits
to its MPI session (`self.mpi_session.submit(worker_main, **worker_kwargs, ...)`,
tensorrt_llm/executor/proxy.py @ b93e14ca093e446615f3009cae6ca5a33c4f2f56), pickled by
reference, in a fresh interpreter.

Our choice (documented in the backend README):
- one GPU: set `TLLM_WORKER_USE_SINGLE_PROCESS=1` before building the LLM, so the
  worker is built in the process that ran `install()`;
- several GPUs under mpirun (`python -m trtllm_moespec.runtime.launch`): every rank calls
  `install_for_engine()` before it serves `MPICommExecutor` or builds the LLM;
- several GPUs without mpirun (one Triton server, as TensorRT-LLM's llmapi Triton model
  runs): TensorRT-LLM spawns the workers, through an `MpiPoolSession` we hand it
  (`reaching_pool_session`) whose tasks first run `run_with_moespec`: it sets the
  environment we pass and installs the worker in the spawned process, then runs the task;
- chain engines need none of it: TensorRT-LLM's linear worker is not patched.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from dataclasses import dataclass
from typing import Any, MutableMapping

from .config import EngineSpec
from .selection import WORKER_POLICIES, WorkerSettings
from .version import check_engine_mode, dynamic_tree_available, installed_version

log = logging.getLogger(__name__)

SINGLE_PROCESS_ENV = "TLLM_WORKER_USE_SINGLE_PROCESS"


def prepare_process_model(world_size: int, model_world_size: int, mode: str = "tree",
                          environ: MutableMapping[str, str] | None = None) -> str:
    """Arrange that TensorRT-LLM builds the model only in processes that run install().

    world_size: ranks mpirun started (1 without mpirun); model_world_size: tp * pp; mode: the
    engine's draft mode. Chain engines run TensorRT-LLM's own linear worker, which needs no
    patch anywhere: TensorRT-LLM may spawn its workers as it likes ("trtllm-managed"). Tree
    engines return "single-process", "mpi-ranks" or "spawned-workers" (the caller must then
    pass `reaching_pool_session` as the LLM's `_mpi_session`); ValueError when the patch
    could not reach.
    """
    environ = os.environ if environ is None else environ
    if mode == "chain":
        if world_size > 1 and world_size != model_world_size:
            raise ValueError(f"mpirun started {world_size} ranks but the engine needs tp*pp = {model_world_size}")
        return "mpi-ranks" if world_size > 1 else "trtllm-managed"
    if model_world_size > 1 and world_size == 1:
        return "spawned-workers"  # the caller hands TensorRT-LLM reaching_pool_session(...)
    if world_size > 1:
        if world_size != model_world_size:
            raise ValueError(f"mpirun started {world_size} ranks but the engine needs tp*pp = {model_world_size}")
        return "mpi-ranks"
    current = environ.get(SINGLE_PROCESS_ENV)
    if current not in (None, "1"):
        raise ValueError(f"{SINGLE_PROCESS_ENV}={current!r} would make TensorRT-LLM build the model in a spawned "
                         "process that never installs the MoESpec worker; unset it or set it to 1")
    environ[SINGLE_PROCESS_ENV] = "1"
    return "single-process"


def run_with_moespec(setup: tuple[str, dict[str, str]], task: Any, /, *args: Any, **kwargs: Any) -> Any:
    """What a spawned TensorRT-LLM worker runs: our environment and worker first, then TensorRT-LLM's task.

    setup: (engine directory, environment variables to set). Module-level, so the call pickles
    by reference like the task itself.
    """
    from .config import load_engine_spec

    engine_dir, environ = setup
    os.environ.update(environ)
    install_for_engine(load_engine_spec(engine_dir), engine_dir)
    return task(*args, **kwargs)


def reaching_session_class(base: type) -> type:
    """A subclass of TensorRT-LLM's `MpiPoolSession` (`base`) whose workers run `run_with_moespec` first."""

    class MoESpecPoolSession(base):
        def __init__(self, n_workers: int, engine_dir: str, environ: dict[str, str] | None = None, **kwargs: Any):
            self._moespec_setup = (str(engine_dir), dict(environ or {}))
            super().__init__(n_workers, **kwargs)

        def submit(self, task: Any, *args: Any, **kwargs: Any) -> Any:
            return super().submit(run_with_moespec, self._moespec_setup, task, *args, **kwargs)

        def submit_sync(self, task: Any, *args: Any, **kwargs: Any) -> Any:
            return super().submit_sync(run_with_moespec, self._moespec_setup, task, *args, **kwargs)

    return MoESpecPoolSession


def reaching_pool_session(n_workers: int, engine_dir: str | Path, environ: dict[str, str] | None = None
                          ) -> Any:  # GPU machines (TensorRT-LLM) only
    """The `_mpi_session` for an LLM whose workers TensorRT-LLM spawns (tensorrt_llm/llmapi/mpi_session.py @
    cc4777e94ddab84b0e2676f1dbcc91b86060329f: `MpiPoolSession(n_workers)`, `submit`, `submit_sync`)."""
    from tensorrt_llm.llmapi.mpi_session import MpiPoolSession

    return reaching_session_class(MpiPoolSession)(n_workers, str(engine_dir), environ)


def options_for_installed(options: dict[str, Any], mode: str) -> dict[str, Any]:
    """An engine YAML adapted to the installed dynamic-tree worker's batch-size contract (tree engines)."""
    if mode != "tree":
        return options
    from .config import with_batch_contract
    from .worker import installed_batch_contract

    return with_batch_contract(options, installed_batch_contract())


_RANK_ENV = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")
_SIZE_ENV = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE")


def mpi_rank_and_size() -> tuple[int, int]:
    """(rank, world size) from the launcher's env vars, else mpi4py, else (0, 1). The env comes first so
    that nothing initialises MPI before the PyTorch expert-parallel path forks its rank supervisor."""
    if any(k in os.environ for k in _SIZE_ENV):
        rank = next((int(os.environ[k]) for k in _RANK_ENV if k in os.environ), 0)
        return rank, next(int(os.environ[k]) for k in _SIZE_ENV if k in os.environ)
    try:
        from mpi4py import MPI

        return MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    except ImportError:
        return 0, 1


def serve_mpi_worker() -> None:  # GPU machines (TensorRT-LLM) only
    """A non-leader rank serves the leader's MpiCommSession (TensorRT-LLM's llmapi Triton model does the same)."""
    from mpi4py.futures import MPICommExecutor
    from mpi4py.MPI import COMM_WORLD

    with MPICommExecutor(COMM_WORLD) as executor:
        if executor is not None:
            raise RuntimeError(f"rank {COMM_WORLD.Get_rank()} unexpectedly became the MPI executor root")


def leader_mpi_session(world_size: int) -> Any:  # GPU machines (TensorRT-LLM) only
    """Rank 0's MpiCommSession over COMM_WORLD (None for one process)."""
    if world_size == 1:
        return None
    from mpi4py.MPI import COMM_WORLD
    from tensorrt_llm.llmapi import MpiCommSession

    return MpiCommSession(comm=COMM_WORLD, n_workers=world_size)


@dataclass(frozen=True)
class WorkerInputs:
    """What an engine directory gives the worker, checked by loading it (not by the paths being set)."""

    cost_table: bool  # cost_profile.json loads: C(k) for evict
    expert_fit: bool  # it carries the (c0, c_tok, c_exp) fit joint needs
    predictor: bool  # the expert predictor directory exists (ecospec, joint)
    problem: str  # why something is missing ("" when nothing is)


def worker_inputs(spec: EngineSpec, engine_dir: str | Path) -> WorkerInputs:
    """Load what the worker's constructor will load (make_selector), so that a missing piece is found here."""
    from ...core.cost import CostTable

    problems, table = [], None
    if spec.cost_profile is not None:
        try:
            table = CostTable.load(Path(engine_dir) / spec.cost_profile)
        except (OSError, ValueError) as e:
            problems.append(f"cost profile: {e}")
    else:
        problems.append("no cost_profile.json (a --dry-run build)")
    if table is not None and table.expert_model is None:
        problems.append(f"{spec.cost_profile} has no expert_model fit")
    has_predictor = spec.predictor is not None and Path(spec.predictor).is_dir()
    if spec.predictor is None:
        problems.append("no expert predictor (--predictor)")
    elif not has_predictor:
        problems.append(f"predictor {spec.predictor} is not a directory")
    return WorkerInputs(table is not None, table is not None and table.expert_model is not None, has_predictor,
                        "; ".join(problems))


def worker_policy(spec: EngineSpec, engine_dir: str | Path) -> str:
    """The policy the TensorRT-LLM worker runs for this engine (what cannot run there degrades, with a warning)."""
    inputs = worker_inputs(spec, engine_dir)
    runnable = {
        "eagle3": True, "coverage": True, "evict": inputs.cost_table, "ecospec": inputs.predictor,
        "joint": inputs.expert_fit and inputs.predictor,
    }
    if runnable.get(spec.policy, False):
        return spec.policy
    fallback = "evict" if inputs.cost_table else "eagle3"
    reason = inputs.problem if spec.policy in runnable else "the PyTorch engine"
    log.warning("policy %s cannot run inside the TensorRT-LLM worker for this engine (%s); using %s",
                spec.policy, reason, fallback)
    return fallback


def worker_settings(spec: EngineSpec, engine_dir: Path) -> WorkerSettings:
    policy = worker_policy(spec, engine_dir)
    assert policy in WORKER_POLICIES
    cost = str(Path(engine_dir) / spec.cost_profile) if spec.cost_profile else None
    return WorkerSettings(policy=policy, cost_profile=cost, predictor=spec.predictor)


def install_for_engine(spec: EngineSpec, engine_dir: str | Path, version: str | None = None) -> Any:
    """What every rank runs before TensorRT-LLM builds its part of the model.

    Tree engines: install the MoESpec worker (returns its InstallRecord). Chain engines:
    only check the version (TensorRT-LLM's linear worker runs; returns None).
    """
    version = version or installed_version()
    check_engine_mode(spec.mode, version, dynamic_tree_available())
    if spec.mode != "tree":
        return None
    from .worker import install

    return install(worker_settings(spec, Path(engine_dir)), version=version, num_experts=spec.model.num_experts)


class _PlannedMode:
    def __init__(self, eagle3_one_model: bool):
        self._one_model = eagle3_one_model

    def is_eagle3_one_model(self) -> bool:
        return self._one_model


class PlannedSpecConfig:
    """The speculative_config of a profile YAML with the attributes get_spec_worker reads
    (`spec_dec_mode.is_eagle3_one_model()`, `use_dynamic_tree`, `dynamic_tree_max_topK`), used to
    report which worker class a rank would build without building one."""

    def __init__(self, options: dict[str, Any]):
        spec = options.get("speculative_config") or {}
        self.spec_dec_mode = _PlannedMode(bool(spec.get("eagle3_one_model")))
        self.use_dynamic_tree = bool(spec.get("use_dynamic_tree"))
        self.dynamic_tree_max_topK = int(spec.get("dynamic_tree_max_topK") or 0)
        self.max_draft_len = spec.get("max_draft_len")
        self.max_total_draft_tokens = spec.get("max_total_draft_tokens")
