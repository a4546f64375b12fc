"""Verification layout: the root plus a selected node list, in the form a target
backend needs to verify the whole tree in one forward.

Layout position 0 is the root (the last committed token); positions 1..K are the
selected nodes in selection order (each after its parent). A backend feeds
`token_ids` at `position_ids(prefix_len)` with `attention_mask(prefix_len)`, where
prefix_len is the number of tokens already in its KV cache (the root is not).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .layout_host import EMPTY_TREE, NOT_PARENT_CLOSED, OUT_OF_RANGE, PADDED_NODE, compiled_layout
from .tree import DraftTree, gather_nodes


@dataclass(frozen=True)
class TreeLayout:
    node_idx: torch.Tensor  # [B, K] int64 tree index of layout positions 1..K, -1 pad
    token_ids: torch.Tensor  # [B, 1+K] int64, position 0 = root token (pad positions repeat the root)
    depth: torch.Tensor  # [B, 1+K] int64, root 0
    parent_pos: torch.Tensor  # [B, 1+K] int64 layout position of the parent, -1 for root and pads
    valid: torch.Tensor  # [B, 1+K] bool, root always valid
    paths: torch.Tensor  # [B, 1+K, D+1] int64 layout positions root->node by depth, -1 pad
    num_nodes: torch.Tensor  # [B] int64 selected nodes (root excluded)

    @property
    def batch_size(self) -> int:
        return self.token_ids.shape[0]

    @property
    def num_positions(self) -> int:
        return self.token_ids.shape[1]

    @property
    def max_depth(self) -> int:
        return self.paths.shape[2] - 1

    def position_ids(self, prefix_len: int | torch.Tensor) -> torch.Tensor:
        """[B, 1+K] int64 = prefix_len + depth."""
        if isinstance(prefix_len, torch.Tensor):
            prefix_len = prefix_len.reshape(-1, 1)
        return self.depth + prefix_len

    def tree_mask(self) -> torch.Tensor:
        """[B, 1+K, 1+K] bool: query i may attend key j iff j is an ancestor of i or i itself."""
        B, T, _ = self.paths.shape
        mask = torch.zeros(B, T, T + 1, dtype=torch.bool, device=self.paths.device)
        # Scatter each path entry into its column; -1 pads land in the extra column T.
        cols = torch.where(self.paths >= 0, self.paths, T)
        mask.scatter_(2, cols, True)
        mask = mask[:, :, :T]
        # Padded queries see only the root so their softmax stays finite.
        root_only = torch.zeros_like(mask)
        root_only[:, :, 0] = True
        return torch.where(self.valid[:, :, None], mask, root_only)

    def attention_mask(
        self,
        prefix_len: int,
        dtype: torch.dtype = torch.float32,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        """[B, 1, 1+K, prefix_len+1+K] additive float mask (0 = attend, finfo.min = blocked).

        The prefix is fully visible to every node; tree keys follow tree_mask().
        With `sliding_window`, a query at position p sees only keys at positions
        > p - window (positions are prefix_len + depth for tree keys), as in
        sliding-window attention layers.
        """
        B, T = self.token_ids.shape
        allowed = torch.cat(
            [torch.ones(B, T, prefix_len, dtype=torch.bool, device=self.token_ids.device), self.tree_mask()], 2
        )
        if sliding_window is not None:
            q_pos = self.position_ids(prefix_len)  # [B, T]
            k_pos = torch.cat(
                [torch.arange(prefix_len, device=q_pos.device).expand(B, prefix_len), q_pos], 1
            )  # [B, P+T]
            allowed &= (q_pos[:, :, None] - k_pos[:, None, :]) < sliding_window
        mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
        mask.masked_fill_(~allowed, torch.finfo(dtype).min)
        return mask[:, None]


def root_layout(root_ids: torch.Tensor) -> TreeLayout:
    """The layout of a plain step: each request's root alone, root_ids [B] (no tree, no selection).
    Equal to `build_layout` of an empty tree and an empty selection, in a handful of ops: a plain
    step pays no layout bookkeeping."""
    roots = root_ids.reshape(-1, 1).long()
    B, device = roots.shape[0], roots.device
    ints = lambda *shape, fill=0: torch.full(shape, fill, dtype=torch.int64, device=device)  # noqa: E731
    return TreeLayout(node_idx=ints(B, 0), token_ids=roots, depth=ints(B, 1), parent_pos=ints(B, 1, fill=-1),
                      valid=torch.ones(B, 1, dtype=torch.bool, device=device), paths=ints(B, 1, 1), num_nodes=ints(B))


def selected_columns(node_idx: torch.Tensor) -> torch.Tensor:
    """node_idx [B, K] (-1 pad) without its trailing columns that select a node in no row (CPU).

    Policies return a fixed-width selection; every laid-out position costs a token of target
    compute, so a verify on the host runs over the selected nodes only (the device path cuts the
    selection to a captured verify length instead). Positions of the kept columns do not move."""
    if node_idx.shape[1] == 0:
        return node_idx
    used = np.flatnonzero((node_idx.numpy() >= 0).any(0))
    return node_idx[:, : int(used[-1]) + 1 if used.size else 0]


def build_layout(tree: DraftTree, node_idx: torch.Tensor, root_ids: torch.Tensor,
                 max_depth: int | None = None) -> TreeLayout:
    """Lay out the root and the selected nodes `node_idx` [B, K] (-1 pad) for verification.

    Raises ValueError when a selected node's parent is neither the root nor an
    earlier selected node (the selection must be ordered and parent-closed).

    `max_depth` (device path only): the deepest selected node's depth, already read back by the
    caller. With it the layout is built without any host synchronisation, and the checks above,
    which would each read a flag back, are skipped: the engine's CUDA step passes it for
    selections made by its own policies (tested parent-closed), so nothing waits on the device
    between selection and verify.
    """
    B, K = node_idx.shape
    if K == 0:  # nothing selected (a cost-aware policy's k = 0): a plain step's layout, no bookkeeping
        return root_layout(root_ids)
    device = tree.token_ids.device
    if device.type == "cpu" and node_idx.device.type == "cpu":
        kernel = compiled_layout() if B == 1 else None
        if kernel is not None:
            return _build_layout_compiled(kernel, tree, node_idx, root_ids)
        return _build_layout_host(tree, node_idx, root_ids)
    return _build_layout_tensors(tree, node_idx, root_ids, max_depth)


def _build_layout_tensors(tree: DraftTree, node_idx: torch.Tensor, root_ids: torch.Tensor,
                          max_depth: int | None = None) -> TreeLayout:
    """build_layout in tensor ops (no host loop: the device path)."""
    B, K = node_idx.shape
    device = tree.token_ids.device
    check = max_depth is None  # each check is a host read of a flag
    if check and tree.num_nodes == 0 and bool((node_idx >= 0).any()):
        raise ValueError("selection names nodes but the tree is empty")
    sel_valid = node_idx >= 0
    if check and bool((sel_valid & ~gather_nodes(tree.valid, node_idx, False)).any()):
        raise ValueError("selection contains a padded (invalid) tree node")

    # Inverse map: tree node -> layout position (0 = not selected).
    pos_of_node = torch.zeros(B, tree.num_nodes + 1, dtype=torch.int64, device=device)
    positions = torch.arange(1, K + 1, device=device).expand(B, K)
    pos_of_node.scatter_(1, torch.where(sel_valid, node_idx, tree.num_nodes), positions)

    tree_parent = gather_nodes(tree.parents, node_idx, -1)
    parent_pos = torch.where(tree_parent >= 0, pos_of_node.gather(1, tree_parent.clamp(min=0)), 0)
    if check and bool((sel_valid & ((parent_pos >= positions) | ((tree_parent >= 0) & (parent_pos == 0)))).any()):
        raise ValueError("selection is not parent-closed and ordered: a node comes before (or without) its parent")
    parent_pos = torch.where(sel_valid, parent_pos, -1)

    root_ids = root_ids.reshape(B, 1).long().to(device)
    node_tokens = torch.where(sel_valid, gather_nodes(tree.token_ids, node_idx, 0), root_ids)
    depth = gather_nodes(tree.depth, node_idx, 0)
    full_parent = torch.cat([torch.full((B, 1), -1, dtype=torch.int64, device=device), parent_pos], 1)
    full_depth = torch.cat([torch.zeros(B, 1, dtype=torch.int64, device=device), depth], 1)
    valid = torch.cat([torch.ones(B, 1, dtype=torch.bool, device=device), sel_valid], 1)
    return TreeLayout(
        node_idx=torch.where(sel_valid, node_idx, -1),
        token_ids=torch.cat([root_ids, node_tokens], 1),
        depth=full_depth,
        parent_pos=full_parent,
        valid=valid,
        paths=_paths(full_parent, full_depth, valid, max_depth),
        num_nodes=sel_valid.sum(1),
    )


_LAYOUT_ERRORS = {
    EMPTY_TREE: (ValueError, "selection names nodes but the tree is empty"),
    PADDED_NODE: (ValueError, "selection contains a padded (invalid) tree node"),
    NOT_PARENT_CLOSED: (ValueError,
                        "selection is not parent-closed and ordered: a node comes before (or without) its parent"),
}


def _build_layout_compiled(kernel, tree: DraftTree, node_idx: torch.Tensor, root_ids: torch.Tensor) -> TreeLayout:
    """build_layout for one CPU request in one compiled call (layout_host.py): the same layout and errors."""
    N = tree.num_nodes
    outcome, *arrays, count = kernel(tree.parents[0].numpy(), tree.token_ids[0].numpy(), tree.depth[0].numpy(),
                                     tree.valid[0].numpy(), node_idx[0].numpy(), int(root_ids.reshape(-1)[0]))
    if outcome == OUT_OF_RANGE:
        raise IndexError(f"selected node index out of range for a tree of {N} nodes")
    if outcome:
        error, message = _LAYOUT_ERRORS[outcome]
        raise error(message)
    nodes, tokens, depth, parent, valid, paths = (torch.from_numpy(a)[None] for a in arrays)
    return TreeLayout(node_idx=nodes, token_ids=tokens, depth=depth, parent_pos=parent, valid=valid, paths=paths,
                      num_nodes=torch.tensor([count]))


def _build_layout_host(tree: DraftTree, node_idx: torch.Tensor, root_ids: torch.Tensor) -> TreeLayout:
    """build_layout on host lists for CPU tensors: the same layout and the same errors.

    A step's tree is a few dozen nodes, so plain Python over lists costs less than the
    ~30 small tensor ops (a few microseconds of dispatch each) of the tensor path.
    """
    B, K = node_idx.shape
    N = tree.num_nodes
    sel = node_idx.tolist()
    if N == 0 and any(n >= 0 for row in sel for n in row):
        raise ValueError("selection names nodes but the tree is empty")
    if N == 0:  # a plain step: the root alone (or padding)
        parents = tokens = depths = valid = [[] for _ in range(B)]
    else:
        parents, tokens, depths, valid = (t.tolist() for t in (tree.parents, tree.token_ids, tree.depth, tree.valid))
    if any(n >= N for row in sel for n in row):
        raise IndexError(f"selected node index out of range for a tree of {N} nodes")
    if any(n >= 0 and not valid[b][n] for b, row in enumerate(sel) for n in row):
        raise ValueError("selection contains a padded (invalid) tree node")
    roots = root_ids.reshape(B).tolist()
    out_nodes, out_tokens, out_depth, out_parent, out_valid, out_paths, counts = [], [], [], [], [], [], []
    for b, row in enumerate(sel):
        pos_of = {n: j for j, n in enumerate(row, 1) if n >= 0}  # tree node -> layout position
        node_row, tok_row, depth_row, parent_row, valid_row = [], [roots[b]], [0], [-1], [True]
        for j, n in enumerate(row, 1):
            if n < 0:
                node_row.append(-1), tok_row.append(roots[b]), depth_row.append(0), parent_row.append(-1)
                valid_row.append(False)
                continue
            tp = parents[b][n]
            pp = pos_of.get(tp, 0) if tp >= 0 else 0
            if pp >= j or (tp >= 0 and pp == 0):
                raise ValueError("selection is not parent-closed and ordered: a node comes before (or without) its parent")
            node_row.append(n), tok_row.append(tokens[b][n]), depth_row.append(depths[b][n]), parent_row.append(pp)
            valid_row.append(True)
        out_nodes.append(node_row), out_tokens.append(tok_row), out_depth.append(depth_row)
        out_parent.append(parent_row), out_valid.append(valid_row), counts.append(len(pos_of))
    max_depth = max((d for row in out_depth for d in row), default=0)
    for b in range(B):
        # A node's path is its parent's (laid out earlier, checked above) plus itself at its depth.
        rows = [[0] + [-1] * max_depth]
        for j in range(1, K + 1):
            if out_valid[b][j]:
                path = rows[out_parent[b][j]].copy()
                path[out_depth[b][j]] = j
            else:
                path = [-1] * (max_depth + 1)
            rows.append(path)
        out_paths.append(rows)
    device = tree.token_ids.device
    as_long = lambda v: torch.tensor(v, dtype=torch.int64, device=device).reshape(B, -1)  # noqa: E731
    return TreeLayout(
        node_idx=as_long(out_nodes),
        token_ids=as_long(out_tokens),
        depth=as_long(out_depth),
        parent_pos=as_long(out_parent),
        valid=torch.tensor(out_valid, dtype=torch.bool, device=device).reshape(B, K + 1),
        paths=torch.tensor(out_paths, dtype=torch.int64, device=device).reshape(B, K + 1, max_depth + 1),
        num_nodes=torch.tensor(counts, dtype=torch.int64, device=device),
    )


def _paths(parent_pos: torch.Tensor, depth: torch.Tensor, valid: torch.Tensor,
           max_depth: int | None = None) -> torch.Tensor:
    """[B, T, D+1] layout positions on the root->node path, indexed by depth (D = max_depth, read
    from `depth` unless the caller already knows it)."""
    B, T = parent_pos.shape
    if max_depth is None:
        max_depth = int(depth.max().item()) if T else 0
    paths = torch.full((B, T, max_depth + 1), -1, dtype=torch.int64, device=parent_pos.device)
    cur = torch.arange(T, device=parent_pos.device).expand(B, T).clone()
    cur = torch.where(valid, cur, -1)
    for _ in range(max_depth + 1):
        alive = cur >= 0
        d = torch.where(alive, depth.gather(1, cur.clamp(min=0)), max_depth + 1)
        scatter_d = torch.where(alive, d, 0)[:, :, None]
        current = paths.gather(2, scatter_d)
        paths.scatter_(2, scatter_d, torch.where(alive[:, :, None], cur[:, :, None], current))
        cur = torch.where(alive, parent_pos.gather(1, cur.clamp(min=0)), -1)
    return paths
