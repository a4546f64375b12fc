"""Triton kernels: equal to the reference in the interpreter (subprocess), and they
compile for sm_90 / sm_80 (PTX + cubin, no GPU needed) without fused multiply-adds."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]


def test_triton_kernels_equal_reference_in_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
           str(Path(__file__).with_name("interp_triton_cases.py"))]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert "passed" in proc.stdout or "[100%]" in proc.stdout


_EVICT_SIG = {"scores_ptr": "*fp32", "order_ptr": "*i64", "valid_ptr": "*u8", "cost_ptr": "*fp64",
              "out_idx_ptr": "*i64", "out_count_ptr": "*i64", "out_expected_ptr": "*fp64", "out_cost_ptr": "*fp64",
              "N": "i32", "K_eff": "i32", "budget": "i32", "NB": "constexpr", "MB": "constexpr"}
_GREEDY_SIG = {"scores_ptr": "*fp32", "parents_ptr": "*i64", "valid_ptr": "*u8", "depth_ptr": "*i64",
               "bits_ptr": "*i64", "root_ptr": "*i64", "buffer_ptr": "*i64", "count_ptr": "*i64", "out_idx_ptr": "*i64",
               "out_count_ptr": "*i64", "out_expected_ptr": "*fp64", "out_cost_ptr": "*fp64", "N": "i32", "W": "i32", "M": "i32",
               "budget": "i32", "token_cost_bits": "i64", "expert_cost_bits": "i64", "c0_bits": "i64",
               "c_tok_bits": "i64", "c_exp_bits": "i64", "NB": "constexpr", "WB": "constexpr", "MB": "constexpr",
               "NC": "constexpr", "MARGINAL": "constexpr", "USE_ROOT": "constexpr", "JOINT": "constexpr"}


@pytest.mark.parametrize("arch", [90, 80])
def test_triton_kernels_compile_for_gpu(arch):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from trtllm_moespec.kernels import triton_select as ts

    target = GPUTarget("cuda", arch, 32)
    opts = {"enable_fp_fusion": False}
    builds = [ASTSource(ts._evict_kernel, _EVICT_SIG, constexprs={"NB": 64, "MB": 64})]
    modes = [(True, True, False), (True, True, True)] if arch == 80 else [(True, True, False), (False, False, False),
                                                                         (True, True, True)]
    for marginal, root, joint in modes:
        builds.append(ASTSource(ts._greedy_kernel, _GREEDY_SIG, constexprs={
            "NB": 64, "WB": 32, "MB": 64, "NC": 32, "MARGINAL": marginal, "USE_ROOT": root, "JOINT": joint}))
    # The default tree's 200 nodes (NB 256) and the largest (4096): node-blocked tiles keep these cheap to build
    # (a whole-tree tile took minutes past NB 512 and spilled kilobytes per thread at 256).
    for NB in (256, 4096):
        builds.append(ASTSource(ts._evict_kernel, _EVICT_SIG, constexprs={"NB": NB, "MB": 64}))
        builds.append(ASTSource(ts._greedy_kernel, _GREEDY_SIG, constexprs={
            "NB": NB, "WB": 32, "MB": 64, "NC": 32, "MARGINAL": True, "USE_ROOT": True, "JOINT": True}))
    for src in builds:
        kernel = triton.compile(src, target=target, options=opts)
        ptx = kernel.asm["ptx"]
        assert f".target sm_{arch}" in ptx
        assert "fma.rn.f64" not in ptx  # keys and costs must round like the reference
        assert "div.rn.f64" in ptx
