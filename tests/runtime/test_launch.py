"""The MPI launcher: rank plans, and a real `mpirun -n 2` without TensorRT-LLM."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from trtllm_moespec.backends.trtllm.config import load_engine_spec
from trtllm_moespec.backends.trtllm.version import trtllm_available
from trtllm_moespec.runtime.launch import launch_plan

MPIRUN = Path(sys.executable).with_name("mpirun")
REPO = Path(__file__).resolve().parents[2]


def test_plans(engine_dir):
    spec = load_engine_spec(engine_dir)  # tp=2, ep=2
    assert launch_plan(spec, 0, 1, "pytorch").role == "leader"
    assert launch_plan(spec, 0, 2, "pytorch").role == "leader"
    other = launch_plan(spec, 1, 2, "pytorch")
    assert other.role == "ep_worker" and "ep=2" in other.message
    with pytest.raises(ValueError, match="started 4 ranks but the engine's expert parallelism is ep=2"):
        launch_plan(spec, 0, 4, "pytorch")
    assert launch_plan(spec, 0, 2, "tensorrt_llm").role == "leader"
    assert launch_plan(spec, 1, 2, "tensorrt_llm").role == "worker"
    with pytest.raises(ValueError, match="needs tp\\*pp = 2\\*1 = 2"):
        launch_plan(spec, 0, 4, "tensorrt_llm")


@pytest.mark.skipif(not MPIRUN.exists() and shutil.which("mpirun") is None, reason="no mpirun (pip mpich) installed")
@pytest.mark.skipif(trtllm_available(), reason="tensorrt_llm installed: ranks would start TensorRT-LLM")
def test_mpirun_two_ranks_without_tensorrt_llm(engine_dir):
    mpirun = str(MPIRUN) if MPIRUN.exists() else shutil.which("mpirun")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run(
        [mpirun, "-n", "2", sys.executable, "-m", "trtllm_moespec.runtime.launch", "--engine-dir", str(engine_dir),
         "--prompt", "hello", "--plan-only"],
        capture_output=True, text=True, timeout=120, env=env,
    )
    assert result.returncode == 0, result.stderr
    assert "rank 0/2: tensorrt_llm not available, PyTorch engine with expert parallelism ep=2" in result.stdout
    assert "rank 1/2: tensorrt_llm not available" in result.stdout and "serves rank 0's verify forwards" in result.stdout


def test_launch_reports_a_missing_engine_dir(tmp_path):
    result = subprocess.run([sys.executable, "-m", "trtllm_moespec.runtime.launch", "--engine-dir", str(tmp_path),
                             "--prompt", "x", "--plan-only"], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    assert result.returncode == 2 and "no moespec.json" in result.stderr
