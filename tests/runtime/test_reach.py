"""The worker patch reaches every process that builds the model: real subprocesses and a real
`mpirun -n 2`, with an on-disk stand-in tensorrt_llm (tests/backends/trtllm_standin.py) that
builds its worker in this process or in a spawned one, as `GenerationExecutor.create` does."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.backends.test_build import eagle3_config, hf_config
from tests.backends.trtllm_standin import write_standin
from trtllm_moespec.backends.trtllm import build
from trtllm_moespec.backends.trtllm.presets import PRESETS
from trtllm_moespec.backends.trtllm.reach import SINGLE_PROCESS_ENV, prepare_process_model

REPO = Path(__file__).resolve().parents[2]
MPIRUN = Path(sys.executable).with_name("mpirun")


def _engine(tmp_path, tp, line="dynamic-tree", name="engine"):
    ckpt, draft = tmp_path / f"{name}-ckpt", tmp_path / f"{name}-draft"
    preset = PRESETS["qwen3-30b-a3b"]
    for d, cfg in ((ckpt, hf_config(preset)), (draft, eagle3_config(preset))):
        d.mkdir()
        (d / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / name
    assert build.main(["--model", "qwen3-30b-a3b", "--checkpoint", str(ckpt), "--draft-model", str(draft),
                       "--policy", "eagle3", "--tp", str(tp), "--ep", str(tp), "--verify-lengths", "8,16",
                       "--trtllm-line", line, "--out", str(out), "--dry-run"]) == 0
    return out


def _env(standin, **extra):
    env = {k: v for k, v in os.environ.items() if k != SINGLE_PROCESS_ENV}
    return {**env, "PYTHONPATH": f"{standin}{os.pathsep}{REPO}", **extra}


def test_prepare_process_model_rules():
    env = {}
    assert prepare_process_model(1, 1, "tree", env) == "single-process" and env[SINGLE_PROCESS_ENV] == "1"
    assert prepare_process_model(2, 2, "tree", {}) == "mpi-ranks"
    assert prepare_process_model(1, 2, "tree", {}) == "spawned-workers"  # reached through reaching_pool_session
    with pytest.raises(ValueError, match="needs tp\\*pp = 2"):
        prepare_process_model(4, 2, "tree", {})
    with pytest.raises(ValueError, match="never installs"):
        prepare_process_model(1, 1, "tree", {SINGLE_PROCESS_ENV: "0"})


def test_chain_engines_need_no_mpirun_and_record_the_range_they_need(tmp_path):
    """F14: a chain engine runs TensorRT-LLM's own linear worker, so TensorRT-LLM may spawn its workers;
    it runs on 1.2.x and on the tree line alike, and says so."""
    from trtllm_moespec.backends.trtllm.config import load_engine_spec
    from trtllm_moespec.backends.trtllm.version import check_engine_mode, check_version_range

    env = {}
    assert prepare_process_model(1, 2, "chain", env) == "trtllm-managed" and env == {}
    assert prepare_process_model(1, 1, "chain", env) == "trtllm-managed" and env == {}
    spec = load_engine_spec(_engine(tmp_path, tp=2, line="1.2", name="chain"))
    assert spec.mode == "chain" and spec.versions["tensorrt_llm_range"] == ">=1.2.0,<2.0.0"
    for version, module in (("1.2.1", False), ("1.3.0rc4", False), ("1.3.2", True)):
        check_version_range(check_engine_mode("chain", version, module), spec.versions["tensorrt_llm_range"])


RUN_PICKLED = "import pickle, sys; f, a, k = pickle.loads(sys.stdin.buffer.read()); print(f(*a, **k))"


class _PoolSession:
    """TensorRT-LLM's MpiPoolSession contract: submit(task, *args, **kwargs) runs the task in each of
    n_workers spawned interpreters. Here: one fresh interpreter per worker, the call pickled as mpi4py does."""

    def __init__(self, n_workers, env=None):
        self.n_workers, self.env = n_workers, env

    def submit(self, task, *args, **kwargs):
        import pickle

        payload = pickle.dumps((task, args, kwargs))
        runs = [subprocess.run([sys.executable, "-c", RUN_PICKLED], input=payload, capture_output=True,
                               timeout=180, env=self.env) for _ in range(self.n_workers)]
        return [subprocess.CompletedProcess(r.args, r.returncode, r.stdout.decode(), r.stderr.decode()) for r in runs]

    def submit_sync(self, task, *args, **kwargs):
        return self.submit(task, *args, **kwargs)


def test_workers_tensorrt_llm_spawns_build_our_worker(tmp_path):
    """Several GPUs without mpirun (one Triton server): TensorRT-LLM spawns the workers and submits its
    worker_main to them; through the session we hand it, each first installs the MoESpec worker."""
    from trtllm_moespec.backends.trtllm.reach import reaching_session_class

    standin = write_standin(tmp_path / "site")
    engine = _engine(tmp_path, tp=2)
    spec = {"eagle3_one_model": True, "use_dynamic_tree": True, "dynamic_tree_max_topK": 8, "max_draft_len": 4,
            "max_total_draft_tokens": 16}
    sys.path.insert(0, str(standin))
    try:
        from tensorrt_llm.executor.worker import worker_main  # the stand-in's: pickled by reference

        plain = _PoolSession(2, env=_env(standin)).submit(worker_main, spec)
        ours = reaching_session_class(_PoolSession)(2, str(engine), {"MOESPEC_TEST": "1"}, env=_env(standin))
        runs = ours.submit(worker_main, spec)
    finally:
        sys.path.remove(str(standin))
        for name in [n for n in sys.modules if n == "tensorrt_llm" or n.startswith("tensorrt_llm.")]:
            del sys.modules[name]
    assert [r.stdout.strip() for r in plain] == ["Eagle3OneModelDynamicTreeWorker"] * 2  # what F6 was about
    assert all(r.returncode == 0 for r in runs), runs[0].stderr[-2000:]
    assert [r.stdout.strip().splitlines()[-1] for r in runs] == ["MoESpecDynamicTreeWorker"] * 2


EXECUTOR_SCRIPT = """
import sys
from trtllm_moespec.runtime.executor import Executor
executor = Executor(sys.argv[1], "tensorrt_llm")
print("worker class:", executor._impl.llm.worker_class)
"""


def test_single_gpu_worker_is_ours_in_the_process_that_builds_it(tmp_path):
    """One GPU: TensorRT-LLM would build the worker in a spawned process that never ran install();
    the executor makes it build in-process (TLLM_WORKER_USE_SINGLE_PROCESS=1)."""
    standin = write_standin(tmp_path / "site")
    engine = _engine(tmp_path, tp=1)
    run = subprocess.run([sys.executable, "-c", EXECUTOR_SCRIPT, str(engine)], capture_output=True, text=True,
                         timeout=180, env=_env(standin))
    assert run.returncode == 0, run.stderr[-2000:]
    assert "worker class: MoESpecDynamicTreeWorker" in run.stdout
    # The stand-in's spawned path really does lose the patch (what the environment variable avoids).
    code = ("from tensorrt_llm import LLM; import os; os.environ.pop('TLLM_WORKER_USE_SINGLE_PROCESS', None); "
            "from trtllm_moespec.backends.trtllm.worker import install, WorkerSettings; install(WorkerSettings('eagle3')); "
            "print(LLM(speculative_config={'eagle3_one_model': True, 'use_dynamic_tree': True, "
            "'dynamic_tree_max_topK': 4, 'max_draft_len': 4, 'max_total_draft_tokens': 8}).worker_class)")
    spawned = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180,
                             env=_env(standin))
    assert spawned.returncode == 0, spawned.stderr[-2000:]
    assert spawned.stdout.strip() == "Eagle3OneModelDynamicTreeWorker"


def test_single_gpu_refuses_a_disabled_single_process_worker(tmp_path):
    standin = write_standin(tmp_path / "site")
    engine = _engine(tmp_path, tp=1)
    run = subprocess.run([sys.executable, "-c", EXECUTOR_SCRIPT, str(engine)], capture_output=True, text=True,
                         timeout=180, env=_env(standin, **{SINGLE_PROCESS_ENV: "0"}))
    assert run.returncode != 0 and "never installs the MoESpec worker" in run.stderr


def test_executor_on_1_2_refuses_a_tree_engine_with_one_clear_error(tmp_path):
    standin = write_standin(tmp_path / "site", version="1.2.1", with_dynamic_tree=False, effective_helper=False)
    engine = _engine(tmp_path, tp=1)
    run = subprocess.run([sys.executable, "-c", EXECUTOR_SCRIPT, str(engine)], capture_output=True, text=True,
                         timeout=180, env=_env(standin))
    assert run.returncode != 0 and "ModuleNotFoundError" not in run.stderr
    assert "tensorrt_llm 1.2.1 does not have" in run.stderr and "--trtllm-line 1.2" in run.stderr


def _mpirun():
    return str(MPIRUN) if MPIRUN.exists() else shutil.which("mpirun")


@pytest.mark.skipif(_mpirun() is None, reason="no mpirun (pip mpich) installed")
def test_mpirun_two_ranks_both_build_our_worker(tmp_path):
    standin = write_standin(tmp_path / "site")
    engine = _engine(tmp_path, tp=2)
    run = subprocess.run([_mpirun(), "-n", "2", sys.executable, "-m", "trtllm_moespec.runtime.launch", "--engine-dir",
                          str(engine), "--prompt", "hello", "--plan-only"], capture_output=True, text=True,
                         timeout=180, env=_env(standin))
    assert run.returncode == 0, run.stderr[-2000:]
    assert "rank 0/2: TensorRT-LLM leader" in run.stdout and "rank 1/2: TensorRT-LLM worker" in run.stdout
    assert "rank 0: worker class MoESpecDynamicTreeWorker" in run.stdout
    assert "rank 1: worker class MoESpecDynamicTreeWorker" in run.stdout


@pytest.mark.skipif(_mpirun() is None, reason="no mpirun (pip mpich) installed")
def test_mpirun_on_1_2_runs_chain_engines_and_refuses_tree_engines(tmp_path):
    standin = write_standin(tmp_path / "site", version="1.2.1", with_dynamic_tree=False, effective_helper=False)
    chain = _engine(tmp_path, tp=2, line="1.2", name="chain")
    run = subprocess.run([_mpirun(), "-n", "2", sys.executable, "-m", "trtllm_moespec.runtime.launch", "--engine-dir",
                          str(chain), "--prompt", "hello", "--plan-only"], capture_output=True, text=True, timeout=180,
                         env=_env(standin))
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.count("worker class TensorRT-LLM linear EAGLE-3 worker (chain mode)") == 2
    tree = _engine(tmp_path, tp=2, name="tree")
    run = subprocess.run([_mpirun(), "-n", "2", sys.executable, "-m", "trtllm_moespec.runtime.launch", "--engine-dir",
                          str(tree), "--prompt", "hello", "--plan-only"], capture_output=True, text=True, timeout=180,
                         env=_env(standin))
    assert run.returncode != 0 and "rank 1: error: this engine drafts an EAGLE-3 dynamic tree" in run.stderr
