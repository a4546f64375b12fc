"""The speculative decode loop, one request at a time:

    prefill -> [ draft -> (predict experts) -> select -> verify -> commit ] * until done

`policy="ar"` runs the same loop with an empty tree, so plain decoding and every
policy share one code path (and one sampling rule). Everything a step needs is
passed explicitly; the only mutable state is the per-request caches.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np
import torch

from ..core.device import token_tensor
from ..core.experts import ExpertSets, popcount
from ..core.layout import TreeLayout, build_layout, root_layout, selected_columns
from ..core.logprobs import TokenLogprob, emitted_positions, prompt_token_logprobs, token_logprobs
from ..core.logit_rules import TokenHistory
from ..core.placement import ExpertPlacement, unique_per_rank_per_layer
from ..core.policies import Selection, SelectionPolicy
from ..core.sampling import SamplingConfig, target_probs
from ..core.seeded import PositionKeys
from ..core.tree import DraftTree, deepest_selected, keep_top_valued
from ..core.values import RequestValues, ValueModel, accepted_nodes, with_values
from ..core.verify import VerifyResult, verify_tree
from ..detokenize import StopCut
from ..models.target import TargetModel, TargetOutput
from .config import TreeConfig
from .drafters import Draft, LazyDraftStart, NoDraft, RequestDrafter
from .guard import Guard, GuardState
from .prefix_cache import DrafterPrefix, PrefixCache, SequenceFeatures
from .structured import GrammarState
from .predictors import peek_full_tree
from .stats import GenerationStats, StepStats


@dataclass
class Request:
    """One generation request and its running output."""

    prompt_ids: list[int]
    sampling: SamplingConfig
    max_tokens: int
    # A seeded request's (api.make_request): its seed keys the position-keyed sampler (core/seeded.py).
    generator: torch.Generator | None
    stop_ids: frozenset[int] = frozenset()
    stop_check: Callable[[list[int]], StopCut | None] | None = None  # where a stop string ends the output, if one did
    logprobs: int | None = None  # report each output token's logprob and this many alternatives (None: off)
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprob] = field(default_factory=list)  # one per output token when logprobs is set
    prompt_logprobs: int | None = None  # the same for the prompt's tokens (None: off)
    prompt_token_logprobs: list[TokenLogprob] = field(default_factory=list)  # prompt tokens 1.., set by the prefill
    history: TokenHistory | None = None  # its logit rules and the tokens they read (None: no rules)
    grammar: GrammarState | None = None  # its structured-output constraint (None: free text)
    features: SequenceFeatures | None = None  # committed positions' target features, followed for the prefix cache
    prefix_cached: bool = False  # the engine keeps the request's K/V for the prefix cache when it finishes
    cached_tokens: int = 0  # prompt tokens the prefix cache supplied (not prefilled)
    steps: list[StepStats] = field(default_factory=list)
    finish_reason: str | None = None
    stop_trim: int = 0  # characters a stop string cut off the end of the output tokens' text (detokenize.StopCut)
    prefill_ms: float = 0.0

    def stats(self) -> GenerationStats:
        return GenerationStats.from_steps(self.steps, len(self.output_ids), self.prefill_ms)

    @property
    def constrained(self) -> bool:
        """Logit rules or a grammar shape its distribution (the guard's sampled prior does not describe it)."""
        return self.history is not None or self.grammar is not None


class SpecEngine:
    """Runs requests through draft -> select -> verify -> commit on one target."""

    def __init__(self, target: TargetModel, policy: SelectionPolicy, tree: TreeConfig, draft_source=None,
                 predictor=None, selector: Callable | None = None, values: ValueModel | None = None,
                 placement: ExpertPlacement | None = None, guard: Guard | None = None,
                 prefix_cache: PrefixCache | None = None):
        self.target = target
        self.policy = policy
        self.tree = tree
        self.draft_source = draft_source if (draft_source is not None and policy.drafts) else NoDraft()
        self.predictor = predictor  # .predict(context_ids, tree, engine) -> (ExpertSets, root bits [1, W]) or None
        self.selector = selector  # optional device op replacing policy.select (same contract)
        self.values = values  # node values for the cost-aware policies (None = raw path scores)
        self.placement = placement  # expert parallelism: which rank holds each expert (stats per rank)
        self.guard = guard if policy.drafts else None  # speculate-or-not before each step (guard.py)
        self.prefix_cache = prefix_cache  # finished prompts' K/V reused by prompts that start alike (prefix_cache.py)

    # ------------------------------------------------------------------ public
    def run(self, request: Request) -> Iterator[list[int]]:
        """Generate for one request, yielding each step's newly committed tokens."""
        device = self.target.device
        prompt = torch.tensor([request.prompt_ids], dtype=torch.int64, device=device)
        cache = self.target.new_cache()
        t0 = time.perf_counter()
        prefill, drafter_prefix = self.prefill(request, cache, prompt)
        root = self._first_token(prefill, request)
        # Under the goodput guard the drafter starts at the request's first speculative step (if any).
        drafter = RequestDrafter(self.draft_source, LazyDraftStart(prompt, prefill, root, drafter_prefix),
                                 lazy=self.guard is not None, constraint=draft_constraint(request))
        request.prefill_ms = (time.perf_counter() - t0) * 1e3
        if self._append(request, [root], prefill.logits[0, -1:]):
            yield request.output_ids[-1:]
            self.keep_prefix(request, cache, drafter)
            return
        yield [root]
        values = self.values.for_request(request.sampling) if self.values and self.policy.uses_values else None
        guard = None
        if self.guard is not None:
            guard = self.guard.start(request.sampling.temperature == 0, request.sampling, request.constrained)
        if values is not None and self.values.name != "head":  # the drafting stop rule ranks on the same values
            drafter.node_values = lambda tree: values.values(tree)
        while True:
            before = len(request.output_ids)
            done = self._step(request, cache, drafter, values, guard)
            yield request.output_ids[before:]
            if done:
                self.keep_prefix(request, cache, drafter)
                return

    def warm_up(self, requests: list[Request]) -> float:
        """Run `requests` (short ones) through every stage of the speculative step, so that a process's
        one-time costs (the compiled kernels' caches loading, first allocations: ~0.3 s on moespec-base,
        against ~30 ms a step) are paid before the first real request; on `unguarded()`, so nothing of
        them stays behind. Returns seconds."""
        t0 = time.perf_counter()
        engine = self.unguarded()
        for request in requests:
            for _ in engine.run(request):
                pass
        return time.perf_counter() - t0

    def unguarded(self) -> "SpecEngine":
        """This engine without the guard (every step speculates, and the guard's time estimates, which
        persist across requests, see none of its steps) and without the prefix cache (it keeps nothing)."""
        engine = copy.copy(self)
        engine.guard = engine.prefix_cache = None
        return engine

    def prefill(self, request: Request, cache, prompt: torch.Tensor) -> tuple[TargetOutput, DrafterPrefix | None]:
        """The prompt [1, L] into an empty cache, through the prefix cache when there is one (which
        then follows the request's committed features), and what its drafter may copy (None: nothing)."""
        out, drafter_prefix = self.prefill_alone(request, cache, prompt)
        return self.track(request, out), drafter_prefix

    def prefill_alone(self, request: Request, cache, prompt: torch.Tensor) -> tuple[TargetOutput, DrafterPrefix | None]:
        """`prefill` without following the request for the prefix cache (a batch follows its requests
        itself). A request that asks for prompt logprobs gets every prompt position's logits, so it
        reuses no cached prefix (whose positions have none); its output keeps the last position's."""
        if request.prompt_logprobs is not None:
            out = self.target.prefill(cache, prompt, all_logits=True)
            request.prompt_token_logprobs = prompt_token_logprobs(out.logits[0], request.prompt_ids,
                                                                  request.prompt_logprobs)
            return TargetOutput(out.logits[:, -1:], out.hidden, out.expert_ids), None
        if self.prefix_cache is None:
            return self.target.prefill(cache, prompt), None
        reused = self.prefix_cache.reused_tokens
        out = self.prefix_cache.prefill(cache, prompt)
        request.cached_tokens = self.prefix_cache.reused_tokens - reused
        return out

    def track(self, request: Request, prefill: TargetOutput) -> TargetOutput:
        """With a prefix cache: the request's K/V will be kept when it finishes, and, when the drafter reads
        target features (EAGLE-3: a later request's drafter starts from them), its committed positions'
        features are followed step by step (a few us per step; nothing for plain decoding)."""
        if self.prefix_cache is not None:
            request.prefix_cached = True
            if self.draft_source.reads_target_features:
                request.features = SequenceFeatures(prefill)
        return prefill

    def keep_prefix(self, request: Request, cache, drafter: RequestDrafter) -> None:
        """A finished request's K/V (and its drafter's, if it ran) go to the prefix cache (when there is one)."""
        if request.prefix_cached:
            kept = drafter.kept_cache() if request.features is not None else None
            self.prefix_cache.store(request.prompt_ids + request.output_ids, cache, request.features, kept)
            request.prefix_cached, request.features = False, None

    def commit(self, request: Request, cache, out: TargetOutput, result: VerifyResult) -> None:
        """Keep the root and the accepted nodes of the step's verify in the target cache."""
        self.target.commit(cache, result.accepted_pos[0])
        if request.features is not None:
            request.features.add(out, emitted_positions(result))

    # ------------------------------------------------------------------ stages
    def _first_token(self, prefill: TargetOutput, request: Request) -> int:
        """Sample the first token from the prefill logits with the same rule (an empty tree)."""
        layout = root_layout(torch.zeros(1, dtype=torch.int64, device=prefill.logits.device))  # the token is unused
        result = self.accept(request, layout, prefill.logits[:, -1:])
        return int(result.emitted_ids[0, 0])

    @staticmethod
    def accept(request: Request, layout: TreeLayout, logits: torch.Tensor) -> VerifyResult:
        """The acceptance rule on one request's step, logits [1, 1+K, V] at its layout positions."""
        return verify_tree(layout, processed_logits(request, logits, layout), [request.sampling], [request.generator],
                           seeds=position_keys([request]))

    def _step(self, request: Request, cache, drafter: "RequestDrafter", values: RequestValues | None = None,
              guard: GuardState | None = None) -> bool:
        t_step = time.perf_counter()
        speculate = guard is None or guard.speculate()  # k = 0 decided before paying for drafting
        t_scout = 0.0
        if guard is not None and drafter.scouts and guard.wants_scout(speculate):
            t0 = time.perf_counter()
            hits = drafter.scout(guard.scout_top)  # the catch-up, reading the drafter's guesses at the skipped steps
            t_scout = time.perf_counter() - t0
            speculate = guard.scout(hits, t_scout, drafter.depth)
        if not (speculate and self.policy.drafts):
            return self._plain_step(request, cache, drafter, guard, speculate, t_step, t_scout)
        context = request.prompt_ids + request.output_ids
        root = context[-1]
        device = self.target.device

        t0 = time.perf_counter()
        drafter.catch_up()  # after plain steps: the switch's price, kept out of the guard's view of this step
        first_guess = drafter.first_guess() if guard is not None and guard.scouts else None  # for its scouts
        t_switch = time.perf_counter() - t0 + t_scout
        draft = drafter.draft(context, device)
        tree = draft.tree_within(request.max_tokens - len(request.output_ids) - 1)  # deeper: never emitted
        t_draft = time.perf_counter() - t0 + t_scout

        t0 = time.perf_counter()
        tree, valued = self.candidates(tree, draft, context, values)
        t_values = time.perf_counter() - t0

        t0 = time.perf_counter()
        experts, root_bits = self._predict(context, tree, draft, cache)
        t_pred = time.perf_counter() - t0

        t0 = time.perf_counter()
        target_scores = self._oracle_scores(cache, tree, root, request) if self.policy.needs_target else None
        selection = self._select(valued, experts, root_bits, target_scores)
        node_idx, max_depth = selection.node_idx, None
        if node_idx.device.type != "cpu":
            node_idx, max_depth = self._device_selection(tree, node_idx)
        else:
            node_idx = selected_columns(node_idx)
        layout = build_layout(tree, node_idx, token_tensor(root, tree.token_ids.device), max_depth)
        t_select = time.perf_counter() - t0 + t_values

        t0 = time.perf_counter()
        out = self.target.verify(cache, layout)
        t_target = time.perf_counter() - t0
        result = self.accept(request, layout, out.logits)
        t_verify = time.perf_counter() - t0

        if values is not None:  # the step's own outcome updates the request's value model (no extra forward)
            t0 = time.perf_counter()
            values.observe(tree, selection.node_idx, accepted_nodes(selection.node_idx, result.accepted_pos))
            t_select += time.perf_counter() - t0
        t0 = time.perf_counter()
        self.commit(request, cache, out, result)
        t_commit = time.perf_counter() - t0
        # Everything the host reads of this step is read before the drafter's forward is queued: on a
        # device a read waits for all queued work, so the bookkeeping below then overlaps that forward.
        emitted = result.emitted_ids[0, : int(result.num_emitted[0])].tolist()
        hits, checked = _predictor_hits(experts, out, layout, result)
        observed = self._observed(layout, out)
        t0 = time.perf_counter()
        drafter.commit(result, out)  # a drafter forward over the committed tokens
        t_draft += time.perf_counter() - t0

        done = self._append(request, emitted, out.logits[0], result)
        first_hit = None if first_guess is None else emitted[0] == first_guess
        self._record(request, guard, True, emitted, observed, t_step, t_switch=t_switch, first_hit=first_hit,
                     draft_ms=t_draft * 1e3,
                     predictor_ms=t_pred * 1e3, select_ms=t_select * 1e3, verify_ms=t_verify * 1e3,
                     target_ms=t_target * 1e3, commit_ms=t_commit * 1e3, predictor_hits=hits, predictor_total=checked)
        return done

    def _plain_step(self, request: Request, cache, drafter: "RequestDrafter", guard: GuardState | None,
                    speculated: bool, t_step: float, t_scout: float = 0.0) -> bool:
        """Verify the root alone (policy "ar", or a step the guard decodes plainly): the forward and
        sampling rule of a tree step with no nodes, without drafting, selection or tree bookkeeping.
        t_scout: seconds of a scout that stopped this step's probe (drafting, left out of the guard's
        plain-step time)."""
        root = request.output_ids[-1] if request.output_ids else request.prompt_ids[-1]
        layout = root_layout(token_tensor(root, self.target.device))
        t0 = time.perf_counter()
        out = self.target.verify(cache, layout)
        t_target = time.perf_counter() - t0
        result = self.accept(request, layout, out.logits)
        t_verify = time.perf_counter() - t0
        t0 = time.perf_counter()
        self.commit(request, cache, out, result)
        t_commit = time.perf_counter() - t0
        t0 = time.perf_counter()
        drafter.defer(result, out)  # caught up in one forward when drafting resumes
        t_draft = time.perf_counter() - t0
        emitted = result.emitted_ids[0].tolist()
        done = self._append(request, emitted, out.logits[0])
        self._record(request, guard, speculated, emitted, self._observed(layout, out), t_step, t_switch=t_scout,
                     draft_ms=(t_draft + t_scout) * 1e3, predictor_ms=0.0, select_ms=0.0, verify_ms=t_verify * 1e3,
                     target_ms=t_target * 1e3, commit_ms=t_commit * 1e3, scouted=t_scout > 0)
        return done

    def _observed(self, layout: TreeLayout, out: TargetOutput) -> dict:
        """What the step's StepStats read from its verify: verified nodes and experts woken."""
        return dict(verified_tokens=0 if layout.num_positions == 1 else int(layout.num_nodes[0]),
                    unique_experts_per_layer=_unique_per_layer(out, self.target.num_experts),
                    **_per_rank_stats(out, self.placement))

    def _record(self, request: Request, guard: GuardState | None, speculated: bool, emitted: list[int],
                observed: dict, t_step: float, t_switch: float = 0.0, first_hit: bool | None = None,
                **times) -> None:
        """The step's StepStats (`observed`: from `_observed`), and its outcome and wall time for the guard:
        less `t_switch`, the drafter's catch-up on the plain steps before it (see `catch_up_all`), and
        `first_hit` (see `GuardState.observe`)."""
        request.steps.append(StepStats(
            accepted_tokens=len(emitted) - 1, committed_tokens=len(emitted),
            step_ms=(time.perf_counter() - t_step) * 1e3, speculated=speculated, **observed, **times,
        ))
        if guard is not None:
            seconds = request.steps[-1].step_ms / 1e3 - t_switch
            guard.observe(speculated, len(emitted), seconds, observed["verified_tokens"], first_hit, t_switch)

    def _device_selection(self, tree: DraftTree, node_idx: torch.Tensor) -> tuple[torch.Tensor, int]:
        """The device path's one host read before the verify: the selected count and deepest depth
        (two ints in one transfer). The count picks the verify length: the selection is cut (or
        -1 padded) to the target's bucket for it, as EVICT pads to a captured length, instead of
        verifying the policy's whole budget; the depth lets the layout skip its own reads."""
        count, depth = torch.stack([(node_idx >= 0).sum(1).max(), deepest_selected(tree, node_idx)]).tolist()
        K = self.target.verify_length(count + 1) - 1
        if K <= node_idx.shape[1]:
            return node_idx[:, :K], depth  # -1 pads come last: the selection is ordered
        return torch.nn.functional.pad(node_idx, (0, K - node_idx.shape[1]), value=-1), depth

    def candidates(self, tree: DraftTree, draft: Draft, context: list[int], values: RequestValues | None
                   ) -> tuple[DraftTree, DraftTree]:
        """The drafted nodes the policy chooses among, as (tree, valued: the same with the request's node
        values as scores, where it has a value model): for a policy that reads expert sets, the top
        `policy.candidate_count` by value (a parent-closed prefix, as EAGLE-3 prunes by score). Expert
        prediction costs per node: over a moespec-base tree of 328 nodes it would cost a tenth of a step,
        while selections take 2-8 nodes. Values only re-rank which nodes are verified; the layout and
        verification use the drafted tree."""
        valued = with_values(tree, values.values(tree, draft, context)) if values is not None else tree
        m = self.policy.candidate_count(self.tree.max_draft_tokens) if self.predictor is not None else None
        return (tree, valued) if m is None else keep_top_valued(tree, valued, m)

    def _predict(self, context: list[int], tree: DraftTree, draft: Draft, cache) -> tuple[ExpertSets | None, torch.Tensor | None]:
        if self.predictor is None or not self.policy.reads_experts:
            return None, None
        return self.predictor.predict(context, tree, draft, cache)

    def _select(self, tree, experts, root_bits, target_scores) -> Selection:
        if self.selector is not None:
            return self.selector(self.policy, tree, experts, root_bits)
        return self.policy.select(tree, experts=experts, root_experts=root_bits, target_scores=target_scores)

    def _oracle_scores(self, cache, tree: DraftTree, root: int, request: Request) -> torch.Tensor:
        """Analysis only: the target's probability of each node given its path (one extra forward)."""
        full, out = peek_full_tree(self.target, cache, tree, root)
        probs = target_probs(out.logits[0], request.sampling)  # [1+N, V]
        parent_pos = full.parent_pos[0].clamp(min=0)
        local = probs[parent_pos, full.token_ids[0]][1:]
        return torch.where(tree.valid[0], local, 0.0)[None]

    def _append(self, request: Request, tokens: list[int], logits: torch.Tensor | None = None,
                result: VerifyResult | None = None) -> bool:
        """Add committed tokens, applying eos, max_tokens and stop strings; True when finished.

        Stop strings are checked after eos / max_tokens too: a stop string completed by the step's
        last token (or before an eos in the same step) still ends the output there. When the
        request asks for logprobs, `logits` are the step's target logits: [P, V] over the layout's
        positions with the step's `result`, else one row per token.
        """
        before = len(request.output_ids)
        if request.logprobs is not None:
            rows = logits if result is None else logits.index_select(0, emitted_positions(result).to(logits.device))
            request.output_logprobs.extend(token_logprobs(rows, tokens, request.logprobs))
        for tok in tokens:
            request.output_ids.append(tok)
            if tok in request.stop_ids:
                request.finish_reason = "stop"
                break
            if len(request.output_ids) >= request.max_tokens:
                request.finish_reason = "length"
                break
        if request.stop_check is not None:
            cut = request.stop_check(request.output_ids)
            if cut is not None:  # the tokens end with the one that completed the stop string, the text before it
                del request.output_ids[cut.num_tokens:]
                request.stop_trim, request.finish_reason = cut.trim, "stop"
        del request.output_logprobs[len(request.output_ids):]  # tokens past eos, max_tokens or a stop string
        for rule in (request.history, request.grammar):
            if rule is not None:
                rule.extend(request.output_ids[before:])
        return request.finish_reason is not None


def position_keys(requests: list[Request]) -> PositionKeys | None:
    """Seeded requests' keys and output positions for the position-keyed rule (core/verify.py): a
    token's random number then depends on its seed and output position only, so the text is the same
    under every policy, batch and guard decision. None when any request has no seed (its generator's
    stream then drives the sequential rule)."""
    if any(r.generator is None for r in requests):
        return None
    return PositionKeys(tuple(r.generator.initial_seed() for r in requests),
                        tuple(len(r.output_ids) for r in requests))


def draft_constraint(request: Request):
    """The request's logit rules and grammar for its drafter (None: it has neither): `(paths, logits
    [F, V_draft], vocab [V_draft]) -> logits` after each token path, so the drafter proposes what the
    target's processed distribution favours (the output does not depend on it)."""
    rules = [rule for rule in (request.history, request.grammar) if rule is not None]
    if not rules:
        return None

    def constrain(paths: list[list[int]], logits: torch.Tensor, vocab: torch.Tensor) -> torch.Tensor:
        for rule in rules:
            logits = rule.apply_draft(logits, vocab, paths)
        return logits

    return constrain


def processed_logits(request: Request, logits: torch.Tensor, layout: TreeLayout | None) -> torch.Tensor:
    """logits [1, T, V] at one request's layout positions under its logit rules (core/logit_rules.py) and
    its grammar (structured.py), each position under its own context; unchanged without either."""
    for rule in (request.history, request.grammar):
        if rule is not None:
            logits = rule.apply(logits[0], layout)[None]
    return logits


def _unique_per_layer(out: TargetOutput, num_experts: int) -> float:
    """Mean over MoE layers of distinct experts woken by the verified tokens."""
    ids = out.expert_ids[0]  # [T, L, topk]
    T, L = ids.shape[:2]
    if T == 1:  # one token's top-k experts are distinct
        return float(ids.shape[2])
    if ids.device.type == "cpu" and num_experts <= 64 and hasattr(np, "bitwise_count"):  # numpy >= 2
        # each layer's woken set as one 64-bit mask: three numpy calls
        bits = np.bitwise_or.reduce(np.left_shift(np.uint64(1), ids.numpy().astype(np.uint64)), axis=(0, 2))  # [L]
        return float(np.bitwise_count(bits).sum()) / L
    if ids.device.type == "cpu":  # a few hundred ints: one numpy sort beats a scatter of tensor ops
        rows = np.sort(ids.numpy().transpose(1, 0, 2).reshape(L, -1), axis=1)  # [L, T * topk]
        return float((np.diff(rows, axis=1) != 0).sum() + L) / L  # distinct = changes along the sorted row + 1
    onehot = torch.zeros(L, num_experts, dtype=torch.bool, device=ids.device)
    onehot.scatter_(1, ids.permute(1, 0, 2).reshape(L, -1), True)
    return float(onehot.sum(1).float().mean())


def _per_rank_stats(out: TargetOutput, placement: ExpertPlacement | None) -> dict:
    """Under EP: distinct experts each rank computed (mean over MoE layers) and U_max per layer."""
    if placement is None:
        return {}
    counts = unique_per_rank_per_layer(out.expert_ids[0], placement).float()  # [N, L]
    return {"unique_experts_per_rank": tuple(counts.mean(1).tolist()),
            "busiest_rank_experts_per_layer": float(counts.max(0).values.mean())}


def _predictor_hits(experts: ExpertSets | None, out: TargetOutput, layout: TreeLayout,
                    result: VerifyResult) -> tuple[int, int]:
    """Predicted (layer, expert) pairs of accepted nodes that the target really used."""
    n = int(result.num_accepted[0])
    if experts is None or n == 0:
        return 0, 0
    pos = result.accepted_pos[0, :n]
    nodes = layout.node_idx[0, pos - 1]
    predicted = experts.bits[0, nodes]  # [n, W]
    actual = ExpertSets.from_topk_ids(out.expert_ids[:, pos], experts.num_experts).bits[0]
    return int(popcount(predicted & actual).sum()), int(popcount(predicted).sum())
