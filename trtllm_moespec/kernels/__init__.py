"""On-device tree selection: the `moespec::select_tree` custom op and its kernels.

- spec.py        the op's contract: inputs, modes, scalar rules, input checks
- reference.py   CPU implementation through the core reference (core/select.py)
- op.py          torch.library registration: CPU -> reference, CUDA -> Triton, fake impl
- triton_select.py  Triton kernels (imported only when a CUDA tensor reaches the op)
- host_lib.py    build and call the CUDA C++ logic compiled for the host (plugins/tree_select)
"""

from .op import select_tree, select_tree_op
from .reference import score_rank_order, select_tree_reference
from .spec import MODE_NAMES, Mode, joint_token_cost, parse_mode

__all__ = ["MODE_NAMES", "Mode", "joint_token_cost", "parse_mode", "score_rank_order", "select_tree", "select_tree_op",
           "select_tree_reference"]
