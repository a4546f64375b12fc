"""`torch.ops.moespec.select_tree`: one op for every on-device selection mode.

Schema (see spec.py for the full contract):

  moespec::select_tree(Tensor scores, Tensor parents, Tensor valid, Tensor depth,
      Tensor node_bits, Tensor root_bits, Tensor cost_table, str mode, SymInt budget,
      float c0, float c_tok, float c_exp, float eps) -> (Tensor, Tensor, Tensor, Tensor)
  returns (node_idx [B, budget] int64, num_selected [B] int64,
           expected_tokens [B] float64, predicted_cost [B] float64)

CPU runs the core reference (reference.py); CUDA runs the Triton kernels
(triton_select.py, imported on first use); the fake implementation gives shapes
and dtypes so the op traces under torch.compile and captures in CUDA graphs (the
CUDA path allocates only its outputs and never synchronises).
"""

from __future__ import annotations

import torch

from ..core.policies import Selection
from .reference import select_tree_reference
from .spec import check_inputs, parse_mode


@torch.library.custom_op("moespec::select_tree", mutates_args=())
def select_tree_op(
    scores: torch.Tensor, parents: torch.Tensor, valid: torch.Tensor, depth: torch.Tensor,
    node_bits: torch.Tensor, root_bits: torch.Tensor, cost_table: torch.Tensor,
    mode: str, budget: int, c0: float, c_tok: float, c_exp: float, eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Default (CPU and any non-CUDA device): the core reference, computed on CPU."""
    cpu = [t.cpu() for t in (scores, parents, valid, depth, node_bits, root_bits, cost_table)]
    sel = select_tree_reference(*cpu, mode=mode, budget=budget, c0=c0, c_tok=c_tok, c_exp=c_exp, eps=eps)
    dev = scores.device
    return (sel.node_idx.to(dev), sel.num_selected.to(dev), sel.expected_tokens.to(dev),
            sel.predicted_cost.to(dev))


@select_tree_op.register_kernel("cuda")
def _select_tree_cuda(scores, parents, valid, depth, node_bits, root_bits, cost_table, mode, budget, c0, c_tok, c_exp,
                      eps):
    from .triton_select import select_tree_triton

    m = parse_mode(mode)
    check_inputs(scores, parents, valid, depth, node_bits, root_bits, cost_table, m, budget, c0, c_tok, c_exp, eps)
    # Triton launches on the current device and its stream: make that the inputs' device (cuda:1 while
    # the current device is cuda:0 would read another GPU's pointers).
    with torch.cuda.device(scores.device):
        return select_tree_triton(scores, parents, valid, depth, node_bits, root_bits, cost_table, m, budget,
                                  c0, c_tok, c_exp, eps)


@select_tree_op.register_fake
def _select_tree_fake(scores, parents, valid, depth, node_bits, root_bits, cost_table, mode, budget, c0, c_tok, c_exp,
                      eps):
    m = parse_mode(mode)
    shapes = check_inputs(scores, parents, valid, depth, node_bits, root_bits, cost_table, m, budget, c0, c_tok,
                          c_exp, eps)
    B = shapes.batch_size
    return (scores.new_empty((B, budget), dtype=torch.int64), scores.new_empty((B,), dtype=torch.int64),
            scores.new_empty((B,), dtype=torch.float64), scores.new_empty((B,), dtype=torch.float64))


def select_tree(
    scores: torch.Tensor, parents: torch.Tensor, valid: torch.Tensor, depth: torch.Tensor,
    node_bits: torch.Tensor, root_bits: torch.Tensor, cost_table: torch.Tensor,
    mode: str, budget: int, c0: float = 0.0, c_tok: float = 0.0, c_exp: float = 0.0, eps: float = 1e-3,
) -> Selection:
    """The op, wrapped into the core's Selection dataclass."""
    out = torch.ops.moespec.select_tree(scores, parents, valid, depth, node_bits, root_bits, cost_table, mode, budget,
                                        float(c0), float(c_tok), float(c_exp), float(eps))
    return Selection(*out)
