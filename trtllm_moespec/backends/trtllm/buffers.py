"""Translation between TensorRT-LLM's EAGLE-3 dynamic-tree buffers and our DraftTree.

Source read: NVIDIA/TensorRT-LLM `tensorrt_llm/_torch/speculative/eagle3_dynamic_tree.py`
@ 057c8a65145bb53caf3939ba4fbcabbad46ea3dc (`Eagle3OneModelDynamicTreeWorker.__init__`,
`update_draft_tokens_and_scores`, `resampling_final_draft_tokens`, `_forward_draft_loop`;
pinned excerpts in tests/backends/fixtures/trtllm/), `dynamic_tree_ops.py` @
42c5bba32aa1faabb962667ee84a489c6efb4afd (`build_dynamic_tree` hands the parent buffer and
the selected indices to `build_dynamic_tree_op`) and the kernel it runs,
cpp/tensorrt_llm/kernels/speculativeDecoding/dynamicTreeKernels.cu @
84e55f930cbab36e096af441a2e07abdb4199db4 (`buildDynamicTreeKernel`).
With K = dynamic_tree_max_topK and D = max_draft_len the worker keeps, per request:

- history_draft_tokens_buffer [B, K + K*K*(D-1)] (int32 @ 057c8a65145bb53caf3939ba4fbcabbad46ea3dc, int64 in
  the other worker, eagle3_dynamic_tree.py @ 470bb72055d5d397c60be4dda1e8f490e7002440)
  and history_score_buffer (same shape, float32): draft step 0 writes the root's top-K tokens and their
  softmax probabilities at [0, K); step l >= 1 writes all K*K children of the
  step's K frontier nodes at [K + (l-1)*K*K, K + l*K*K), child c of frontier slot f
  at offset f*K + c, with score = parent score * child probability. Scores are
  therefore path probabilities (our `scores`), tokens already in the target vocabulary.
- history_draft_tokens_parent_buffer [B, max(K*(D-1)+1, K+1)] int64: entry 0 is -1
  (the root), entries 1..K are 0..K-1 (the step-0 nodes), and entries 1+l*K .. l*K+K
  hold the history indices of the frontier chosen at step l. Hence the parent of
  history node h is -1 for h < K and parent_buffer[h // K] otherwise (the same rule
  the tree-building kernel applies).
- resampling_final_draft_tokens(batch_size) returns `_resample_final_tokens(scores,
  tokens, N)`: (real_draft_tokens [B, N], topk_score_indices [B, N] int64) with N =
  max_total_draft_tokens, the history indices of the top-N scores sorted ascending and
  their tokens. build_dynamic_tree then derives mask, positions and retrieve indices
  from those indices and the parent buffer; it needs N distinct, parent-closed indices
  (padding.py fills what our policy leaves free).

A history index is used directly as our node index: parents precede children.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...core.tree import DraftTree


def history_size(topk: int, max_draft_len: int) -> int:
    """Nodes in the history buffers: K + K*K*(D-1)."""
    return topk + topk * topk * (max_draft_len - 1)


def parent_buffer_size(topk: int, max_draft_len: int) -> int:
    """Entries of the parent buffer: max(K*(D-1)+1, K+1)."""
    return max(topk * (max_draft_len - 1) + 1, topk + 1)


@dataclass(frozen=True)
class DynamicTreeHistory:
    """The dynamic-tree worker's history buffers for a batch (views, not copies)."""

    draft_tokens: torch.Tensor  # [B, K + K*K*(D-1)] int32/int64 history_draft_tokens_buffer
    scores: torch.Tensor  # [B, K + K*K*(D-1)] float32 history_score_buffer (path probabilities)
    parents: torch.Tensor  # [B, max(K*(D-1)+1, K+1)] int64 history_draft_tokens_parent_buffer
    topk: int  # dynamic_tree_max_topK
    max_draft_len: int  # drafting steps D

    def validate(self) -> None:
        """Raise ValueError unless the shapes are TensorRT-LLM's for (topk, max_draft_len)."""
        if self.topk < 1 or self.max_draft_len < 1:
            raise ValueError(f"topk and max_draft_len must be positive, got {self.topk}, {self.max_draft_len}")
        H, P = history_size(self.topk, self.max_draft_len), parent_buffer_size(self.topk, self.max_draft_len)
        B = self.draft_tokens.shape[0]
        for name, tensor, width in (("draft_tokens", self.draft_tokens, H), ("scores", self.scores, H), ("parents", self.parents, P)):
            if tensor.dim() != 2 or tuple(tensor.shape) != (B, width):
                raise ValueError(f"history {name} has shape {tuple(tensor.shape)}, expected ({B}, {width}) for K={self.topk}, D={self.max_draft_len}")


def history_parent_index(parents: torch.Tensor, topk: int, num_history: int) -> torch.Tensor:
    """[B, H] int64 parent history index of every history node (-1 = root).

    parents: [B, P] the worker's parent buffer.
    """
    h = torch.arange(num_history, device=parents.device)
    slot = (h // topk).clamp(max=parents.shape[1] - 1)
    gathered = parents.long()[:, slot]  # [B, H]
    return torch.where(h < topk, torch.full_like(gathered, -1), gathered)


def history_depth(topk: int, num_history: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[H] int64 depth of each history node: 1 for step 0, l + 1 for step l."""
    h = torch.arange(num_history, device=device)
    return torch.where(h < topk, 1, (h - topk) // (topk * topk) + 2)


def draft_tree_from_history(history: DynamicTreeHistory, checks: bool = True) -> DraftTree:
    """Our DraftTree over all history nodes (node idx = history idx).

    Local probabilities are recovered as score / parent score; nodes with a zero
    score (unused slots) are padding. checks=False skips the shape check and
    DraftTree.validate() (both synchronise with the host, which a CUDA graph
    capture forbids); the construction itself is branch-free tensor code.
    """
    if checks:
        history.validate()
    B, H = history.scores.shape
    device = history.scores.device
    parents = history_parent_index(history.parents, history.topk, H)
    scores = history.scores.float()
    parent_scores = torch.where(parents >= 0, scores.gather(1, parents.clamp(min=0)), torch.ones_like(scores))
    valid = (scores > 0) & torch.isfinite(scores)
    q = torch.where(valid, scores / parent_scores.clamp(min=torch.finfo(torch.float32).tiny), torch.zeros_like(scores))
    depth = history_depth(history.topk, H, device).expand(B, H)
    tree = DraftTree(
        token_ids=history.draft_tokens.long(),
        parents=torch.where(valid, parents, torch.full_like(parents, -1)),
        depth=torch.where(valid, depth, torch.zeros_like(depth)),
        draft_probs=q.clamp(0.0, 1.0),
        log_scores=torch.where(valid, scores.log(), torch.full_like(scores, float("-inf"))),
        valid=valid,
    )
    if checks:
        tree.validate()
    return tree


def device_score_order(tree: DraftTree) -> torch.Tensor:
    """[B, N] node idx by (valid first, score desc, depth asc, index asc), on the tree's device.

    The same order as core.tree.score_order, computed with three stable device sorts
    (least significant key first) instead of a host lexsort, so it can run inside a
    captured CUDA graph.
    """
    B, N = tree.token_ids.shape
    order = torch.arange(N, device=tree.token_ids.device).expand(B, N)
    neg_score = torch.where(tree.valid, -tree.log_scores.double(), torch.full_like(tree.log_scores, float("inf"), dtype=torch.float64))
    for key in (tree.depth, neg_score, (~tree.valid).to(torch.int8)):
        position = key.gather(1, order).sort(dim=1, stable=True).indices
        order = order.gather(1, position)
    return order


def top_n_resampling(history: DynamicTreeHistory, verify_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """TensorRT-LLM's own pruning, `_resample_final_tokens`: (tokens [B, N], history indices [B, N]).

    The top-N history scores, their indices sorted ascending, and the tokens gathered there
    (in the history buffer's dtype). tests/backends/fixtures/ holds the upstream text this
    is checked against.
    """
    indices = history.scores.topk(verify_length, dim=-1).indices.sort().values
    return history.draft_tokens.gather(1, indices), indices


def selected_parent_positions(history: DynamicTreeHistory, indices: torch.Tensor) -> torch.Tensor:
    """[B, N] int64 position (within `indices`) of each selected node's parent; -1 = root.

    This is the tree the verifier will see. Raises ValueError when a parent is not
    selected (TensorRT-LLM's tree builder assumes a parent-closed selection).
    """
    parents = history_parent_index(history.parents, history.topk, history.scores.shape[1])
    node_parent = parents.gather(1, indices)  # [B, N]
    match = indices[:, None, :] == node_parent[:, :, None]  # [B, N(child), N(candidate parent)]
    found = match.any(-1)
    if ((node_parent >= 0) & ~found).any():
        b, i = ((node_parent >= 0) & ~found).nonzero()[0].tolist()
        raise ValueError(f"request {b}: selected node {int(indices[b, i])} has unselected parent {int(node_parent[b, i])}")
    return torch.where(node_parent >= 0, match.float().argmax(-1), torch.full_like(node_parent, -1))


def chain_tree(draft_tokens: torch.Tensor, draft_probs: torch.Tensor) -> DraftTree:
    """A linear EAGLE-3 draft as a DraftTree: node i's parent is i-1.

    draft_tokens, draft_probs: [B, D] (chain mode: sliding-window targets).
    """
    B, D = draft_tokens.shape
    parents = (torch.arange(D, device=draft_tokens.device) - 1).expand(B, D)
    return DraftTree.from_parents(draft_tokens, parents, draft_probs.float().clamp(0.0, 1.0))


def chain_prefix_length(node_idx: torch.Tensor) -> torch.Tensor:
    """[B] int64 verified prefix length of a parent-closed selection on a chain.

    Raises ValueError unless the selected nodes are exactly 0..k-1 (a prefix).
    """
    chosen = node_idx >= 0
    k = chosen.sum(1)
    ascending = torch.where(chosen, node_idx, torch.iinfo(torch.int64).max).sort(1).values
    position = torch.arange(node_idx.shape[1], device=node_idx.device)
    is_prefix = torch.where(position < k[:, None], ascending == position, True).all()
    if not bool(is_prefix):
        raise ValueError("a chain selection must be a prefix of the chain (parent-closed)")
    return k
