"""Build and call the CUDA C++ selection logic compiled for the host.

plugins/tree_select/tree_select.h holds the per-request algorithms as
__host__ __device__ code; tree_select_host.cpp exposes them through a C ABI.
`build_host_library` compiles that file with the C++ compiler into a shared
library and `HostTreeSelect` calls it through ctypes, so the C++ logic runs (and
is tested against the reference) on machines without a GPU.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import torch

from ..core.policies import Selection
from .spec import check_inputs, parse_mode

SOURCE_DIR = Path(__file__).resolve().parents[2] / "plugins" / "tree_select"
HOST_FLAGS = ("-O2", "-std=c++17", "-shared", "-fPIC", "-ffp-contract=off")
_STATUS = {1: "bad mode", 2: "bad budget", 3: "bad scalar (eps or joint cost model)", 4: "bad cost table",
           5: "bad shape"}


def build_host_library(out_dir: str | Path, compiler: str = "g++", source_dir: Path = SOURCE_DIR) -> Path:
    """Compile tree_select_host.cpp into out_dir/libmoespec_tree_select_host.so; returns its path."""
    src = Path(source_dir) / "tree_select_host.cpp"
    if not src.is_file():
        raise FileNotFoundError(f"{src} not found: the C++ sources live in the repository's plugins/tree_select/")
    if shutil.which(compiler) is None:
        raise FileNotFoundError(f"C++ compiler {compiler!r} not found on PATH")
    out = Path(out_dir) / "libmoespec_tree_select_host.so"
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [compiler, *HOST_FLAGS, "-I", str(src.parent), "-o", str(out), str(src)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"host build failed ({' '.join(cmd)}):\n{proc.stderr}")
    return out


def _ptr(t: torch.Tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr())


class HostTreeSelect:
    """ctypes binding of moespec_tree_select_host (see tree_select_api.h)."""

    def __init__(self, library: str | Path):
        self.lib = ctypes.CDLL(str(library))
        fn = self.lib.moespec_tree_select_host
        i64, f64, vp = ctypes.c_int64, ctypes.c_double, ctypes.c_void_p
        fn.argtypes = [i64, i64, i64, vp, vp, vp, vp, vp, vp, vp, i64, ctypes.c_int32, i64, f64, f64, f64, f64, i64,
                       vp, vp, vp, vp]
        fn.restype = ctypes.c_int32
        self._fn = fn

    def select(
        self, scores: torch.Tensor, parents: torch.Tensor, valid: torch.Tensor, depth: torch.Tensor,
        node_bits: torch.Tensor, root_bits: torch.Tensor, cost_table: torch.Tensor,
        mode: str | int, budget: int, c0: float = 0.0, c_tok: float = 0.0, c_exp: float = 0.0, eps: float = 1e-3,
        num_lanes: int = 1,
    ) -> Selection:
        """Same contract as the op (CPU tensors; scores are passed as float32)."""
        call, out = self.bind(scores, parents, valid, depth, node_bits, root_bits, cost_table, mode, budget, c0, c_tok,
                              c_exp, eps, num_lanes)
        status = call()
        if status != 0:
            raise ValueError(f"moespec_tree_select_host failed: {_STATUS.get(status, status)}")
        return out

    def bind(
        self, scores: torch.Tensor, parents: torch.Tensor, valid: torch.Tensor, depth: torch.Tensor,
        node_bits: torch.Tensor, root_bits: torch.Tensor, cost_table: torch.Tensor,
        mode: str | int, budget: int, c0: float = 0.0, c_tok: float = 0.0, c_exp: float = 0.0, eps: float = 1e-3,
        num_lanes: int = 1,
    ):
        """Check and convert once; returns (call() -> status, Selection that each call overwrites)."""
        m = parse_mode(mode)
        shapes = check_inputs(scores, parents, valid, depth, node_bits, root_bits, cost_table, m, budget, c0, c_tok,
                              c_exp, eps)
        B, N, W = shapes.batch_size, shapes.num_nodes, shapes.num_words
        keep = [scores.float().contiguous(), parents.long().contiguous(), valid.to(torch.uint8).contiguous(),
                depth.long().contiguous(), node_bits.contiguous(), root_bits.contiguous(),
                cost_table.double().contiguous() if cost_table.numel() else torch.zeros(1, dtype=torch.float64)]
        out = Selection(torch.empty(B, budget, dtype=torch.int64), torch.empty(B, dtype=torch.int64),
                        torch.empty(B, dtype=torch.float64), torch.empty(B, dtype=torch.float64))
        args = (B, N, W, *map(_ptr, keep), cost_table.shape[0], int(m), budget, c0, c_tok, c_exp, eps, num_lanes,
                *map(_ptr, (out.node_idx, out.num_selected, out.expected_tokens, out.predicted_cost)))
        fn = self._fn

        def call() -> int:
            _ = keep  # the converted inputs stay alive as long as the call does
            return fn(*args)

        return call, out
