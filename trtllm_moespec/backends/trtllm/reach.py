"""Making the worker patch reach every process that builds the model.

`install()` patches modules of the process it runs in. TensorRT-LLM builds the model
elsewhere unless told otherwise (executor/executor.py @ ed53795b, `GenerationExecutor.
create`): with one GPU it spawns a worker process through mpi4py unless
`TLLM_WORKER_USE_SINGLE_PROCESS` is set, and with a model world size above 1 and no
mpirun it spawns MPI workers; under mpirun with an `MpiCommSession`, rank 0 runs its
part in-process and the other ranks run theirs through `MPICommExecutor`.

Our choice (documented in the backend README):
- one GPU: set `TLLM_WORKER_USE_SINGLE_PROCESS=1` before building the LLM, so the
  worker is built in the process that ran `install()`;
- several GPUs: only under mpirun (`python -m trtllm_moespec.runtime.launch` or the
  Triton model), where every rank calls `install_for_engine()` before it serves
  `MPICommExecutor` or builds the LLM; a multi-GPU engine started without mpirun is
  refused, because the workers TensorRT-LLM would spawn never run `install()`.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, MutableMapping

from .config import EngineSpec
from .selection import EXPERT_POLICIES, WORKER_POLICIES, WorkerSettings
from .version import check_engine_mode, dynamic_tree_available, installed_version

log = logging.getLogger(__name__)

SINGLE_PROCESS_ENV = "TLLM_WORKER_USE_SINGLE_PROCESS"


def prepare_process_model(world_size: int, model_world_size: int,
                          environ: MutableMapping[str, str] | None = None) -> str:
    """Arrange that TensorRT-LLM builds the model only in processes that run install().

    world_size: ranks mpirun started (1 without mpirun); model_world_size: tp * pp.
    Returns "single-process" or "mpi-ranks"; ValueError when the patch could not reach.
    """
    environ = os.environ if environ is None else environ
    if model_world_size > 1 and world_size == 1:
        raise ValueError(
            f"this engine needs {model_world_size} GPUs (tp*pp); without mpirun TensorRT-LLM would spawn worker "
            f"processes that never install the MoESpec worker: run `mpirun -n {model_world_size} python -m "
            "trtllm_moespec.runtime.launch --engine-dir ...` (or the Triton model under mpirun)")
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


def worker_policy(spec: EngineSpec) -> str:
    """The policy the TensorRT-LLM worker runs for this engine (what cannot run there degrades, with a warning)."""
    has_cost, has_predictor = spec.cost_profile is not None, spec.predictor is not None
    runnable = {
        "eagle3": True, "coverage": True, "evict": has_cost, "ecospec": has_predictor,
        "joint": has_cost and has_predictor,
    }
    if runnable.get(spec.policy, False):
        return spec.policy
    fallback = "evict" if has_cost else "eagle3"
    log.warning("policy %s cannot run inside the TensorRT-LLM worker for this engine (it needs %s); using %s",
                spec.policy, "a cost profile and an expert predictor" if spec.policy in EXPERT_POLICIES
                else "a cost profile" if spec.policy == "evict" else "the PyTorch engine", fallback)
    return fallback


def worker_settings(spec: EngineSpec, engine_dir: Path) -> WorkerSettings:
    policy = worker_policy(spec)
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
