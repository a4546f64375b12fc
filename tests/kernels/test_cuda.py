"""GPU checks (skipped without CUDA): the op on CUDA (Triton) == the op on CPU, also
under CUDA graph capture; the CUDA C++ kernels (nvcc-built library) == the reference."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from trtllm_moespec.core.policies import Selection
from trtllm_moespec.kernels import parse_mode, select_tree, select_tree_reference

from .cases import MODES, assert_same_selection, random_case

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
ROOT = Path(__file__).resolve().parents[2]
SHAPES = [(1, 64, 48, 128), (8, 64, 48, 128), (3, 17, 94, 256), (5, 1, 2, 16), (2, 0, 3, 16)]


@pytest.mark.parametrize("batch, nodes, layers, experts", SHAPES)
def test_op_cuda_equals_cpu(batch, nodes, layers, experts):
    for seed in range(3):
        case = random_case(seed, batch, nodes, layers=layers, experts=experts, topk=8 if experts > 16 else 2)
        for mode in MODES:
            want = select_tree(*case.args(), mode=mode, **case.kwargs())
            got = select_tree(*(t.cuda() for t in case.args()), mode=mode, **case.kwargs())
            assert_same_selection(want, got, f"{mode} seed={seed}")


def test_op_cuda_graph_capture():
    case = random_case(1, 4, 64, layers=48, experts=128, topk=8, budget=32)
    args = [t.cuda() for t in case.args()]
    for mode in MODES:
        want = select_tree(*case.args(), mode=mode, **case.kwargs())
        select_tree(*args, mode=mode, **case.kwargs())  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = select_tree(*args, mode=mode, **case.kwargs())
        graph.replay()
        torch.cuda.synchronize()
        assert_same_selection(want, out, f"graph {mode}")


@pytest.fixture(scope="module")
def cuda_lib(tmp_path_factory):
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not on PATH")
    major, minor = torch.cuda.get_device_capability()
    out = tmp_path_factory.mktemp("cuda_lib") / "libmoespec_tree_select.so"
    src = ROOT / "plugins" / "tree_select" / "tree_select.cu"
    subprocess.run(["nvcc", f"-arch=sm_{major}{minor}", "-std=c++17", "-O2", "-shared", "-Xcompiler", "-fPIC",
                    "-o", str(out), str(src)], check=True)
    lib = ctypes.CDLL(str(out))
    i64, f64, vp = ctypes.c_int64, ctypes.c_double, ctypes.c_void_p
    lib.moespec_tree_select_cuda.argtypes = [i64, i64, i64, vp, vp, vp, vp, vp, vp, vp, i64, ctypes.c_int32, i64,
                                             f64, f64, f64, f64, vp, vp, vp, vp, vp, ctypes.c_int32, vp]
    lib.moespec_tree_select_cuda.restype = ctypes.c_int32
    lib.moespec_tree_select_workspace_bytes.argtypes = [i64, i64, i64]
    lib.moespec_tree_select_workspace_bytes.restype = ctypes.c_size_t
    return lib


@pytest.mark.parametrize("batch, nodes, layers, experts", SHAPES)
@pytest.mark.parametrize("threads", [32, 128])
def test_cuda_cpp_equals_reference(cuda_lib, batch, nodes, layers, experts, threads):
    case = random_case(4, batch, nodes, layers=layers, experts=experts, topk=8 if experts > 16 else 2)
    dev = [case.scores.float().cuda(), case.parents.cuda(), case.valid.to(torch.uint8).cuda(), case.depth.cuda(),
           case.node_bits.cuda(), case.root_bits.cuda(),
           case.cost_table.cuda() if case.cost_table.numel() else torch.zeros(1, dtype=torch.float64, device="cuda")]
    W = case.node_bits.shape[2]
    for mode in MODES:
        want = select_tree_reference(*case.args(), mode=mode, **case.kwargs())
        out = Selection(torch.empty(batch, case.budget, dtype=torch.int64, device="cuda"),
                        torch.empty(batch, dtype=torch.int64, device="cuda"),
                        torch.empty(batch, dtype=torch.float64, device="cuda"),
                        torch.empty(batch, dtype=torch.float64, device="cuda"))
        ws = torch.empty(max(1, cuda_lib.moespec_tree_select_workspace_bytes(batch, nodes, W)), dtype=torch.uint8,
                         device="cuda")
        status = cuda_lib.moespec_tree_select_cuda(
            batch, nodes, W, *(t.data_ptr() for t in dev), case.cost_table.shape[0], int(parse_mode(mode)),
            case.budget, case.c0, case.c_tok, case.c_exp, case.eps,
            *(t.data_ptr() for t in (out.node_idx, out.num_selected, out.expected_tokens, out.predicted_cost)),
            ws.data_ptr(), threads, torch.cuda.current_stream().cuda_stream)
        torch.cuda.synchronize()
        assert status == 0
        assert_same_selection(want, out, f"{mode} threads={threads}")
