"""`moespec replay record`: decode live and keep every step's whole draft tree, the values the
live value model gave it, predicted and true expert sets, and the target's acceptance of every
node (one extra peek forward per step, discarded; it never changes what the live run does).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..core.experts import ExpertSets, pack_expert_ids
from ..core.sampling import target_probs
from ..engine.engine import Request, SpecEngine
from ..engine.predictors import peek_full_tree
from .records import RecordBuilder


@dataclass
class _Pending:
    nodes: dict
    root_pred: np.ndarray
    root_true: np.ndarray
    context_len: int
    selected: np.ndarray | None = None


class RecordingEngine(SpecEngine):
    """The live engine plus a recorder: same drafting, selection and verification, so the
    committed tokens and the live selections are exactly those of `SpecEngine`."""

    def __init__(self, engine: SpecEngine, builder: RecordBuilder, expert_source, keep_hidden: bool = True):
        super().__init__(engine.target, engine.policy, engine.tree, engine.draft_source, engine.predictor,
                         engine.selector, engine.values)
        self.builder, self.expert_source, self.keep_hidden = builder, expert_source, keep_hidden
        self.draft_source = _CommitTap(engine.draft_source, self)
        self._request: Request | None = None
        self._request_idx = -1
        self._pending: _Pending | None = None
        self._drafted = None  # this step's drafted tree before the policy's candidate cut

    def run(self, request: Request):
        self._request = request
        self._request_idx = self.builder.start_request(request.sampling.temperature)
        yield from super().run(request)
        self.builder.finish_request(request.prompt_ids + request.output_ids)

    def candidates(self, tree, *args):
        self._drafted = tree  # the record keeps every drafted node: replay cuts to each policy's candidates itself
        return super().candidates(tree, *args)

    def _predict(self, context, tree, draft, cache):
        experts, root_bits = super()._predict(context, tree, draft, cache)
        drafted = self._drafted
        if drafted.num_nodes == 0:
            self._pending = None
            return experts, root_bits
        full, out = peek_full_tree(self.target, cache, drafted, context[-1])
        probs = target_probs(out.logits[0], self._request.sampling)  # [1+N, V]
        valid = drafted.valid[0]
        local = torch.where(valid, probs[full.parent_pos[0].clamp(min=0), full.token_ids[0]][1:], 0.0)
        E = self.target.num_experts
        true_bits = pack_expert_ids(out.expert_ids[0, 1:], E)  # [N, W] (layout position i+1 is node i)
        true_bits = torch.where(valid[:, None], true_bits, torch.zeros_like(true_bits))
        pred, pred_root = self._predicted(context, tree, drafted, draft, cache, experts, root_bits)
        W = true_bits.shape[-1]
        nodes = {"token_ids": drafted.token_ids[0].numpy(), "parents": drafted.parents[0].numpy(),
                 "valid": valid.numpy().astype(np.uint8),
                 "draft_probs": drafted.draft_probs[0].numpy(), "target_local": local.float().numpy(),
                 "true_experts": true_bits.numpy(),
                 "pred_experts": pred.bits[0].numpy() if pred is not None else np.zeros((drafted.num_nodes, W), np.int64)}
        hidden = getattr(draft, "node_hidden", None)
        if self.keep_hidden and hidden is not None:
            nodes["node_hidden"] = hidden[0].to(torch.float16).numpy()
        self._pending = _Pending(
            nodes, pred_root[0].numpy() if pred_root is not None else np.zeros(W, np.int64),
            pack_expert_ids(out.expert_ids[0, 0], E).numpy(), len(context))
        return experts, root_bits

    def _predicted(self, context, candidates, drafted, draft, cache, experts, root_bits):
        """Predicted expert sets of every drafted node: the live policy's own predictions for its candidates
        (exactly what it selected on), the expert source's for the rest (what another policy replayed on
        these steps may choose among)."""
        if experts is not None and candidates is drafted:
            return experts, root_bits
        if self.expert_source is None:
            return experts, root_bits
        pred, pred_root = self.expert_source.predict(context, drafted, draft, cache)
        if experts is None:
            return pred, pred_root
        chosen = candidates.valid[0]
        bits = pred.bits.clone()
        bits[0, chosen] = experts.bits[0, chosen]
        return ExpertSets(bits, pred.num_layers, pred.num_experts), root_bits

    def _select(self, tree, experts, root_bits, target_scores):
        selection = super()._select(tree, experts, root_bits, target_scores)
        if self._pending is not None:
            self._pending.nodes["values"] = tree.scores[0].numpy()  # the (valued) tree the policy ranked
            sel = selection.node_idx[0]
            self._pending.selected = sel[sel >= 0].numpy()
        return selection

    def _committed(self, result) -> None:
        p, self._pending = self._pending, None
        if p is None:
            return
        self.builder.add_step(p.nodes, self._request_idx, p.context_len, p.root_pred, p.root_true, p.selected,
                              int(result.num_accepted[0]))


class _CommitTap:
    """Forwards to the real draft source and tells the recorder the step's verify result."""

    def __init__(self, inner, recorder: RecordingEngine):
        self.inner, self.recorder, self.name = inner, recorder, inner.name

    def start(self, *args):
        return self.inner.start(*args)

    def catch_up(self, states) -> None:
        self.inner.catch_up(states)

    def draft(self, *args):
        return self.inner.draft(*args)

    def commit(self, state, result, verify) -> None:
        self.recorder._committed(result)
        self.inner.commit(state, result, verify)


def expert_source_for(llm):
    """Where predicted expert sets come from when the live policy needs none: the model's
    own draft-head predictor (ours), else its standalone predictor, else nothing."""
    from dataclasses import replace

    from ..resolve import load_predictor

    if llm.engine.predictor is not None:
        return llm.engine.predictor
    paths = llm.paths
    if paths.predictor_head is not None:
        paths = replace(paths, predictor=paths.predictor_head)
    if paths.predictor is None:
        return None
    drafter = getattr(llm.engine.draft_source, "drafter", None)  # the loaded EAGLE-3 drafter (a head must match it)
    return load_predictor(None, paths, llm.target, drafter if llm.engine.draft_source.name == "eagle3" else None)


def record(llm, prompts: list[list[int]], params: list, meta: dict, keep_hidden: bool = True, progress=None):
    """Decode each prompt (with its SamplingParams) under llm's live policy; returns (ReplayFile, outputs)."""
    if not llm.policy.drafts:
        raise ValueError("replay record needs a drafting policy (eagle3, evict, joint, ...), not 'ar'")
    E = llm.target.num_experts
    builder = RecordBuilder({**meta, "num_layers": len(llm.target.moe_layers), "num_experts": E,
                             "num_words": int(ExpertSets.from_topk_ids(torch.zeros(1, 1, len(llm.target.moe_layers), 1,
                                                                                      dtype=torch.int64), E).bits.shape[-1])})
    engine = RecordingEngine(llm.engine, builder, expert_source_for(llm), keep_hidden)
    outputs = []
    for ids, p in zip(prompts, params, strict=True):
        request = llm.make_request(ids, p)
        for _ in engine.run(request):
            pass
        outputs.append(list(request.output_ids))
        if progress is not None:
            progress.update(1)
    return builder.build(), outputs
