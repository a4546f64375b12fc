"""Padding a selection to TensorRT-LLM's captured verify length with copies that wake no new experts.

TensorRT-LLM's dynamic-tree worker verifies exactly N = max_total_draft_tokens draft
tokens per request and step: N is fixed when the worker is built
(`self.max_total_draft_tokens = spec_config.tokens_per_gen_step - 1`), and the verify reads
`spec_metadata.draft_tokens.reshape(num_gens, N - 1)` with N = tokens_per_gen_step
(`_sample_and_accept_dynamic_tree`),
in tensorrt_llm/_torch/speculative/eagle3_dynamic_tree.py @ 057c8a65145bb53caf3939ba4fbcabbad46ea3dc.
The number of tokens each request verifies is set on the host before the forward, from
the batch size only (`draft_len_schedule`, tensorrt_llm/llmapi/llm_args.py @
0004396720054fd8e205cbf616f21f0b57c6b412), so the worker cannot pick a smaller verify
length per step from inside the captured graph. A policy that chose k < N nodes must
therefore hand back N distinct history indices anyway.

Padding with the next-best nodes by score (what this module replaces) turns evict's
prefix back into TensorRT-LLM's own top-N and re-adds the experts joint avoided.
Instead, each free slot holds a *copy* of an already selected node v: the same token and
the same parent. TensorRT-LLM's tree builder (`buildDynamicTreeKernel`,
cpp/tensorrt_llm/kernels/speculativeDecoding/dynamicTreeKernels.cu @
84e55f930cbab36e096af441a2e07abdb4199db4) derives a node's parent from its history index h
alone (`parentList[h / topK]`, the root for h < topK) and orders siblings by position,
i.e. by ascending history index. So a copy placed at a free slot whose parent entry is
v's parent, at a higher index than v:
- attends to exactly v's ancestors at v's position, hence has v's hidden state in every
  layer and routes to v's experts: the verify wakes only the selection's experts;
- comes after v among its siblings: the greedy walk (`verifyDynamicTreeGreedyKernel`, same
  file) accepts the first sibling whose token is the target's, which is v, so a copy is
  never accepted nor committed; nor under exact-match sampling (sample at the parent,
  then the same walk). The target-only rejection kernel adds each sibling's target
  probability to one running sum, which would count a duplicated token twice: engines
  therefore write `use_rejection_sampling: false` and the worker refuses it (worker.py).

Free slots with v's parent: v's own group of K siblings (native slots), and any group
that holds no selected node, whose parent-buffer entry is re-pointed to the parent of an
anchor a (the selected node of depth >= 2 with the lowest group), holding copies of a.
Re-pointing only changes entries of groups the verify would not use otherwise; the
drafting loop rewrites every entry it reads next step (`update_draft_tokens_and_scores`).
When even that cannot hold N - k copies (k = 0, or root children only), the selection is
first extended, by as few real nodes as make room (`num_extended`): the best root child
when it is empty, then the best child of a selected node (an anchor); failing that (one
drafting step, say), the next-best nodes by score.
All of it is branch-free tensor code, safe inside a captured CUDA graph (checks=False).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...core.tree import DraftTree
from .buffers import DynamicTreeHistory, device_score_order


@dataclass(frozen=True)
class PaddedVerify:
    """What `resampling_final_draft_tokens` hands to TensorRT-LLM, and how it was made."""

    draft_tokens: torch.Tensor  # [B, N] real_draft_tokens (history dtype): tokens of the verified slots
    topk_score_indices: torch.Tensor  # [B, N] int64 history indices, ascending, distinct, parent-closed
    parents: torch.Tensor  # [B, P] int64 parent buffer for build_dynamic_tree (re-pointed groups applied)
    is_copy: torch.Tensor  # [B, N] bool: the slot is a copy of an earlier sibling (never accepted)
    num_selected: torch.Tensor  # [B] int64 nodes the policy chose
    num_extended: torch.Tensor  # [B] int64 real nodes added by score so that the copies fit (usually 0)


@dataclass(frozen=True)
class _CopySlots:
    native: torch.Tensor  # [..., H] bool free slot after the first selected node of its group
    native_source: torch.Tensor  # [..., H] int64 that first selected node
    repoint: torch.Tensor  # [..., H] bool slot of a group with no selected node, after the anchor's group
    anchor: torch.Tensor  # [...] int64 history index of the anchor (H when there is none)

    @property
    def capacity(self) -> torch.Tensor:
        return (self.native | self.repoint).sum(-1)


def _copy_slots(selected: torch.Tensor, topk: int) -> _CopySlots:
    """Free slots that can hold a copy, for selections [..., H] (no host reads)."""
    *lead, H = selected.shape
    G = H // topk
    groups = selected.reshape(*lead, G, topk)  # [..., G, K]
    offset = torch.arange(topk, device=selected.device)
    first = torch.where(groups, offset, topk).amin(-1)  # [..., G] first selected offset, K if none
    used = first < topk
    native = (~groups) & (offset > first[..., None]) & used[..., None]
    group_idx = torch.arange(G, device=selected.device)
    native_source = (group_idx * topk + first.clamp(max=topk - 1))[..., None].expand(*lead, G, topk)
    anchor_group = torch.where(used & (group_idx >= 1), group_idx, G).amin(-1)  # [...]
    has_anchor = anchor_group < G
    anchor = torch.where(has_anchor, anchor_group * topk + first.gather(-1, anchor_group.clamp(max=G - 1)[..., None])
                         .squeeze(-1), torch.full_like(anchor_group, H))
    repoint_group = (~used) & (group_idx > anchor_group[..., None]) & has_anchor[..., None]  # [..., G]
    repoint = repoint_group[..., None].expand(*lead, G, topk)
    return _CopySlots(native.reshape(*lead, H), native_source.reshape(*lead, H), repoint.reshape(*lead, H), anchor)


def _best(mask: torch.Tensor, log_scores: torch.Tensor) -> torch.Tensor:
    """[B, H] one-hot of the best-scoring node where mask holds (all False when it never does)."""
    keyed = torch.where(mask, log_scores, torch.full_like(log_scores, float("-inf")))
    best = keyed.argmax(1, keepdim=True)
    return torch.zeros_like(mask).scatter_(1, best, mask.gather(1, best))


def _extensions(tree: DraftTree, selected: torch.Tensor, verify_length: int) -> torch.Tensor:
    """[B, N + 3, H] parent-closed supersets of the selection, tried in order: itself; plus the best root
    child when it is empty; plus the best child (depth >= 2) of a selected node, which anchors re-pointed
    groups; then the selection plus the e = 1..N best unselected nodes by score (the general fallback)."""
    B, H = selected.shape
    valid, log_scores = tree.valid, tree.log_scores
    root_child = _best(valid & (tree.depth == 1) & ~selected & ~selected.any(1, keepdim=True), log_scores)
    with_root = selected | root_child
    parent_selected = with_root.gather(1, tree.parents.clamp(min=0)) & (tree.parents >= 0)
    anchor = _best(valid & ~with_root & (tree.depth >= 2) & parent_selected, log_scores)
    order = device_score_order(tree)  # [B, H] valid first, score desc, parent before child
    order = order.gather(1, selected.gather(1, order).to(torch.int8).argsort(dim=1, stable=True))  # unselected first
    rank = torch.empty_like(order).scatter_(1, order, torch.arange(H, device=order.device).expand(B, H))
    steps = torch.arange(1, verify_length + 1, device=selected.device)
    prefixes = selected[:, None] | ((valid & ~selected)[:, None] & (rank[:, None] < steps[None, :, None]))
    return torch.cat([selected[:, None], with_root[:, None], (with_root | anchor)[:, None], prefixes], dim=1)


def _extend_until_copies_fit(tree: DraftTree, selected: torch.Tensor, topk: int, verify_length: int
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(selection [B, H], nodes added [B], feasible [B]): the first of `_extensions` that leaves room
    for the copies. All candidates are evaluated at once, so the choice needs no host read."""
    B, H = selected.shape
    candidates = _extensions(tree, selected, verify_length)  # [B, E, H]
    need = verify_length - candidates.sum(-1)
    feasible = (need >= 0) & (_copy_slots(candidates, topk).capacity >= need)
    attempt = torch.arange(candidates.shape[1], device=selected.device)
    first = torch.where(feasible, attempt, candidates.shape[1]).amin(-1)  # [B]
    pick = first.clamp(max=candidates.shape[1] - 1)
    chosen = candidates.gather(1, pick[:, None, None].expand(B, 1, H)).squeeze(1)
    return chosen, chosen.sum(-1) - selected.sum(-1), first < candidates.shape[1]


def pad_with_copies(history: DynamicTreeHistory, tree: DraftTree, node_idx: torch.Tensor, verify_length: int,
                    checks: bool = True) -> PaddedVerify:
    """The policy's selection plus copies, N = verify_length slots per request.

    node_idx: [B, M] parent-closed selection (-1 pad) over history indices. checks=True
    raises ValueError for a selection above N or a tree that cannot be padded (host reads);
    checks=False is the graph-safe path.
    """
    B, H = history.draft_tokens.shape
    K, N = history.topk, verify_length
    device = history.draft_tokens.device
    chosen = node_idx >= 0
    selected = torch.zeros(B, H + 1, dtype=torch.bool, device=device)
    selected.scatter_(1, torch.where(chosen, node_idx, H), True)
    selected = selected[:, :H]
    num_selected = chosen.sum(1)
    if checks and (num_selected > N).any():
        raise ValueError(f"selection of {int(num_selected.max())} nodes exceeds the captured verify length {N}")
    selected, num_extended, feasible = _extend_until_copies_fit(tree, selected, K, N)
    if checks and not bool(feasible.all()):
        raise ValueError(f"the draft tree cannot be padded to verify length {N} (too few real nodes)")
    slots = _copy_slots(selected, K)
    h = torch.arange(H, device=device).expand(B, H)
    free = slots.native | slots.repoint
    # Native slots first (no parent-buffer change), then re-pointed groups, each by index.
    key = torch.where(slots.native, h, torch.where(slots.repoint, H + h, 2 * H + h))
    rank = key.argsort(dim=1, stable=True).argsort(dim=1)
    copy = free & (rank < (N - selected.sum(-1))[:, None])
    source = torch.where(selected, h, torch.where(slots.native, slots.native_source, slots.anchor[:, None]))
    verified = selected | copy
    indices = torch.where(verified, h, H).sort(dim=1).values[:, :N]  # [B, N] ascending
    tokens = history.draft_tokens.gather(1, source.clamp(max=H - 1)).gather(1, indices.clamp(max=H - 1))
    parents = _repoint_parents(history, slots, copy)
    return PaddedVerify(tokens, indices.long(), parents, copy.gather(1, indices.clamp(max=H - 1)), num_selected,
                        num_extended)


def _repoint_parents(history: DynamicTreeHistory, slots: _CopySlots, copy: torch.Tensor) -> torch.Tensor:
    """[B, P] the parent buffer with every group that holds a re-pointed copy pointing at the anchor's parent."""
    B, H = copy.shape
    K = history.topk
    G = H // K
    parents = history.parents.long()
    groups = (copy & slots.repoint).reshape(B, G, K).any(-1)  # [B, G]
    anchor_slot = (slots.anchor // K).clamp(max=G - 1)  # the parent entry of the anchor's own group
    anchor_parent = parents.gather(1, anchor_slot[:, None])  # [B, 1]
    head = torch.where(groups, anchor_parent, parents[:, :G])
    return torch.cat([head, parents[:, G:]], dim=1)
