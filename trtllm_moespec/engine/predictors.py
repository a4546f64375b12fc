"""Expert-set sources for the expert-aware policies (EcoSpec, joint).

- `LearnedExperts`: the trained expert predictor (one small forward per step).
- `OracleExperts`: analysis only — the target's true routing of every drafted node,
  from an extra target forward that is discarded afterwards.
Both return per-node ExpertSets [1, N, W] and the root's set [1, W].
"""

from __future__ import annotations

import numpy as np
import torch

from ..core.experts import ExpertSets, num_words, pack_expert_ids
from ..core.greedy_host import compiled_greedy
from ..core.layout import build_layout
from ..core.tree import DraftTree


def peek_full_tree(target, cache, tree: DraftTree, root: int):
    """Analysis only: one target forward over the root and every drafted node, then discarded.

    Returns (layout, TargetOutput); the cache is left exactly as it was.
    """
    order = torch.arange(tree.num_nodes, device=tree.token_ids.device)[None]
    layout = build_layout(tree, torch.where(tree.valid, order, -1), torch.tensor([root], device=order.device))
    out = target.verify(cache, layout)
    target.discard(cache)
    return layout, out


class LearnedExperts:
    def __init__(self, predictor, num_experts: int):
        self.predictor, self.num_experts = predictor, num_experts

    def predict(self, context: list[int], tree: DraftTree, draft, cache) -> tuple[ExpertSets, torch.Tensor]:
        device = tree.token_ids.device
        # the context goes to the host anyway (the predictor builds its masks there): never via the device
        node_topk, root_topk = self.predictor.predict_tree(torch.tensor(context), tree)
        experts = ExpertSets.from_topk_ids(node_topk[None].to(device), self.num_experts)
        return experts, pack_expert_ids(root_topk[None].to(device), self.num_experts)


class OracleExperts:
    def __init__(self, target):
        self.target = target

    def predict(self, context: list[int], tree: DraftTree, draft, cache) -> tuple[ExpertSets, torch.Tensor]:
        _, out = peek_full_tree(self.target, cache, tree, context[-1])
        ids = out.expert_ids  # [1, 1+N, L, topk]
        experts = ExpertSets.from_topk_ids(ids[:, 1:], self.target.num_experts)
        return experts, pack_expert_ids(ids[:, 0], self.target.num_experts)


class HeadExperts:
    """Our draft-head predictor: routing from the EAGLE-3 drafter's per-node hidden, no extra forward.

    Node i's feature is (draft.node_hidden[i], embedding of its token, its depth); the root's is
    (hidden that proposed the depth-1 nodes = the drafter output at the last committed position,
    which consumed the root token; embedding of the root).
    """

    def __init__(self, head, embed_tokens: torch.nn.Embedding, num_experts: int):
        self.head, self.num_experts = head.bind_embedding(embed_tokens), num_experts

    def predict(self, context: list[int], tree: DraftTree, draft, cache) -> tuple[ExpertSets, torch.Tensor]:
        hidden = getattr(draft, "node_hidden", None)
        if hidden is None:
            raise ValueError("the draft-head expert predictor needs the EAGLE-3 drafter's node_hidden; this draft "
                             "source has none (use the standalone predictor or predictor='oracle')")
        if hidden.shape[:2] != tree.token_ids.shape or tree.batch_size != 1:
            raise ValueError(f"node_hidden {tuple(hidden.shape)} does not match the tree {tuple(tree.token_ids.shape)} "
                             "(batch 1 only)")
        device = tree.token_ids.device
        if tree.num_nodes == 0:
            raise ValueError("the draft-head expert predictor needs at least one drafted node (the root's feature "
                             "is the hidden that proposed the depth-1 nodes)")
        # Only valid nodes are predicted (the head costs per row; `SpecEngine.candidates` may have left a
        # few dozen of ~200); the others get no experts, and no policy selects them.
        rows = tree.valid[0].nonzero()[:, 0]
        kernels = compiled_greedy() if device.type == "cpu" and self.head.device.type == "cpu" else None
        if kernels is not None:  # the top-K and the bitsets in one compiled loop (core/greedy_host.py)
            logits = self.head.predict_logits(hidden[0, rows], tree.token_ids[0, rows], tree.depth[0, rows],
                                              hidden[0, 0], context[-1])  # [R + 1, L, E], the root's last
            if logits.shape[2] != self.num_experts:
                raise ValueError(f"the draft-head predictor scores {logits.shape[2]} experts per layer, the target "
                                 f"has {self.num_experts}")
            words = np.empty((logits.shape[0], num_words(logits.shape[1], self.num_experts)), dtype=np.int64)
            kernels[2](logits.numpy(), self.head.config.target_topk, words)
            bits = np.zeros((tree.num_nodes, words.shape[1]), dtype=np.int64)
            bits[rows.numpy()] = words[:-1]
            experts = ExpertSets(torch.from_numpy(bits)[None], logits.shape[1], self.num_experts)
            return experts, torch.from_numpy(words[-1:])
        topk, root_topk = self.head.predict(hidden[0, rows], tree.token_ids[0, rows], tree.depth[0, rows],
                                            hidden[0, 0], context[-1])
        node_topk = topk.new_full((tree.num_nodes, *topk.shape[1:]), -1)
        node_topk[rows.to(topk.device)] = topk
        experts = ExpertSets.from_topk_ids(node_topk[None].to(device), self.num_experts)
        return experts, pack_expert_ids(root_topk[None].to(device), self.num_experts)
