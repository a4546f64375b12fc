"""Every CUDA source compiles with nvcc for sm_80 and sm_90 (compile only, -c to objects)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CU_FILES = sorted((ROOT / "plugins").rglob("*.cu"))
NVCC = shutil.which("nvcc")


def test_cuda_sources_exist():
    assert ROOT / "plugins" / "tree_select" / "tree_select.cu" in CU_FILES
    assert ROOT / "plugins" / "trt" / "tree_select_plugin_kernels.cu" in CU_FILES  # no TensorRT headers needed


@pytest.mark.skipif(NVCC is None, reason="nvcc not on PATH: the CUDA toolkit is not installed on this machine")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_nvcc_compiles(tmp_path, arch):
    for cu in CU_FILES:
        obj = tmp_path / f"{cu.stem}_{arch}.o"
        cmd = [NVCC, f"-arch={arch}", "-std=c++17", "-O2", "-Werror", "all-warnings", "-I", str(cu.parent),
               "-c", str(cu), "-o", str(obj)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
        assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stderr[-4000:]}"
        assert obj.stat().st_size > 0
        if shutil.which("cuobjdump"):  # the object really holds code for this architecture
            elf = subprocess.run(["cuobjdump", "--list-elf", str(obj)], capture_output=True, text=True)
            assert arch in elf.stdout, elf.stdout + elf.stderr


def test_host_source_compiles_warning_free(tmp_path):
    if shutil.which("g++") is None:
        pytest.skip("g++ not on PATH")
    src = ROOT / "plugins" / "tree_select" / "tree_select_host.cpp"
    cmd = ["g++", "-std=c++17", "-O2", "-Wall", "-Wextra", "-Werror", "-fsyntax-only", str(src)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
