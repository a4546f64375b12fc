"""Batched decoding: every admitted request advances by one iteration in ONE target forward.

    step():  new requests: prefill (one forward each) -> first token
             running requests: speculate or not, for the whole batch (the goodput guard of a
               batch policy, decided before any drafting; plain: no drafter forward)
               -> draft (every request's drafter forwards packed: one per drafting step for the
                  whole batch, `Eagle3Source.draft_batch`) + predict per request
               -> select (each request's own policy, or a batch policy across the batch:
                  joint-batch, evict-batch, ecospec-batch)
               -> one target forward over all roots + selected nodes: ragged trees padded to
                  the longest, per-request positions, tree masks and static-cache slots
               -> per request: acceptance rule, in-place commit in its slot; then the drafters
                  take their accepted tokens in one packed forward

Why each request is unchanged by its neighbours (greedy output identical to running it
alone, sampling distribution unchanged): the forward sees request b's keys only in b's
cache slot and b's tree mask; padding repeats the root token at the root's position and
sees only the root, so it computes the root's values again and wakes no new expert; the
acceptance rule runs per request on the unpadded layout, so a request draws exactly the
uniforms from its own generator that it would draw alone (a seeded one, those of its seed and
output positions, core/seeded.py). A selection made across the
batch changes which nodes are verified, never how they are accepted, so sampling stays
lossless (DESIGN: any tree chosen without the verifier's random numbers); the guard decides
from past steps' timings only.

Admission and retirement happen between steps (`add` / `abort`, driven by the serving
scheduler). A request's slot is released when it finishes or is aborted.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from ..core.batch_select import ecospec_batch_select, evict_batch_select, joint_batch_select
from ..core.device import host_tensor, token_tensor
from ..core.layout import TreeLayout, build_layout, root_layout, selected_columns
from ..core.select import path_bits
from ..core.tree import DraftTree, deepest_selected, gather_nodes, top_k_nodes
from ..core.values import RequestValues, accepted_nodes
from ..core.verify import VerifyResult, verify_tree
from ..models.target import TargetCache, TargetModel, TargetOutput
from .batch_cost import BatchCosts, BatchTableCosts, GoodputGuard, GuardsByKind
from .drafters import Draft, LazyDraftStart, RequestDrafter, catch_up_all, commit_all, draft_all
from .engine import (Request, SpecEngine, _predictor_hits, _unique_per_layer, draft_constraint, position_keys,
                     processed_logits)
from .guard import GREEDY_SCOUT_TOP
from .stats import StepStats


@dataclass
class _Active:
    """An admitted request and its per-request state."""

    request: Request
    cache: TargetCache | None = None  # None until its prefill ran
    # The request's drafter; lazily started under a guarded batch policy (until the batch first speculates
    # it has not seen the prompt: the prompt's prefill and the plain steps since wait in it).
    drafter: RequestDrafter | None = None
    values: RequestValues | None = None  # node values of the cost-aware policies (None: raw path scores)


@dataclass(frozen=True)
class BatchStepOutput:
    """One request's share of a batch step (the serving layer's StepOutput is built from it)."""

    request: Request
    new_ids: list[int]
    finished: bool
    step: StepStats | None  # None for the prefill step


class BatchedEngine:
    """Continuous batching over one `SpecEngine`'s target, drafter, predictor and policy.

    `batch_policy` replaces the per-request policy by a selection across the batch
    (core/batch_select.py), on the loaded policy's drafter, predictor and costs:
      "joint-batch" (policy joint; `joint_batch=True` is the same): greedy on the batch's shared
          expert union, stopped at the batch's utility peak on per-batch-size costs (`costs`;
          default: the joint fit with intercepts measured per batch size);
      "evict-batch" (policy evict): EVICT's top nodes by value across the requests, k* at the
          batch's utility peak on the profiled C(k) with a measured per-batch-size intercept;
      "ecospec-batch" (policy ecospec): EcoSpec's greedy on the batch's union, B times its budget.
    joint-batch and evict-batch run, unless `goodput_guard=False`, a guard that decodes plainly
    (no drafter forward at all) when speculation does not pay for the batch; ecospec-batch runs
    it only when given one (EcoSpec's rule has no cost model: the baseline as published). Without
    a batch policy each request keeps its own policy's selection, and the batch is guarded when the
    loaded engine is (`guard` "auto" guards the cost-aware policies): a served cost-aware policy is
    never left speculating where plain decoding of the batch is faster.
    """

    def __init__(self, engine: SpecEngine, max_batch_size: int, joint_batch: bool = False,
                 costs: BatchCosts | BatchTableCosts | None = None, goodput_guard: bool | GoodputGuard = True,
                 batch_policy: str | None = None):
        if not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise ValueError(f"max_batch_size must be a positive integer, got {max_batch_size!r}")
        if engine.policy.needs_target:
            raise ValueError(f"policy {engine.policy.name!r} needs target scores per request (analysis only); "
                             "it cannot run batched")
        if joint_batch and batch_policy not in (None, "joint-batch"):
            raise ValueError(f"joint_batch=True contradicts batch_policy={batch_policy!r}")
        batch_policy = "joint-batch" if joint_batch else batch_policy
        _check_batch_policy(engine, batch_policy)
        self.engine, self.target = engine, engine.target
        self.max_batch_size = max_batch_size
        self.batch_policy = batch_policy
        self.joint_batch = batch_policy == "joint-batch"
        # joint without its expert term (the profile says it cannot pay here) selects as EVICT does
        self._selects_as = "evict-batch" if self.joint_batch and not engine.policy.reads_experts else batch_policy
        self.costs = costs if costs is not None else _default_costs(engine, self._selects_as)
        if isinstance(goodput_guard, GoodputGuard):
            self.guard: GoodputGuard | GuardsByKind | None = goodput_guard if batch_policy is not None else None
        else:
            guarded = batch_policy in ("joint-batch", "evict-batch") or (batch_policy is None and engine.guard is not None)
            prior = engine.guard.prior if engine.guard is not None else None  # the model's, for sampled batches
            self.guard = GuardsByKind(prior) if goodput_guard and guarded else None
        self._active: dict[int, _Active] = {}  # id(request) -> state, in admission order
        # Plain steps (chosen by the guard) skip the drafter: the draft source remembers their tokens and
        # catches up in one forward before it next drafts (drafters.Eagle3Source.defer, as SpecEngine's
        # guard does). The drafter's prompt prefill (about a target prefill's cost) waits too, until the
        # request's batch first speculates: requests that never speculate never pay for a drafter forward.
        self._defer_drafter = self.guard is not None

    def warm_up(self, requests: list[Request]) -> float:
        """`SpecEngine.warm_up` for the batched step: `requests` decoded together, every step speculative,
        by a batch engine of their own over `engine.unguarded()` (this one's batch guard and admitted
        requests are untouched). Returns seconds."""
        t0 = time.perf_counter()
        batch = BatchedEngine(self.engine.unguarded(), len(requests), costs=self.costs, goodput_guard=False,
                              batch_policy=self.batch_policy)
        for request in requests:
            batch.add(request)
        while batch.num_active:
            batch.step()
        return time.perf_counter() - t0

    # ------------------------------------------------------------------ admission
    @property
    def num_active(self) -> int:
        return len(self._active)

    def add(self, request: Request) -> None:
        if len(self._active) >= self.max_batch_size:
            raise ValueError(f"engine full: {self.max_batch_size} requests already admitted")
        self._active[id(request)] = _Active(request)

    def abort(self, request: Request) -> None:
        # Dropping the state drops its TargetCache, whose static-cache slot returns to the pool when
        # the object is collected (the pool releases it then; releasing it here as well could free a
        # slot that a later request already holds).
        self._active.pop(id(request), None)

    def run_all(self, requests: list[Request], on_finish: Callable[[Request], None] | None = None) -> None:
        """Run requests to completion with continuous batching (admit as many as fit before each
        step): the synchronous entry point for batch callers such as `LLM.generate` and the runtime
        Executor. `on_finish` is called with each request as it finishes (progress bars)."""
        waiting = list(requests)
        while waiting or self._active:
            while waiting and len(self._active) < self.max_batch_size:
                self.add(waiting.pop(0))
            outputs, _ = self.step()
            for out in outputs:
                if out.finished and on_finish is not None:
                    on_finish(out.request)

    # ------------------------------------------------------------------ one step
    def step(self) -> tuple[list[BatchStepOutput], float]:
        """Advance every admitted request; returns their outputs and the batch's unique experts
        per layer (mean over MoE layers of the experts the verify forward woke, pads excluded)."""
        t_step = time.perf_counter()
        new = [a for a in self._active.values() if a.cache is None]
        running = [a for a in self._active.values() if a.cache is not None]
        outputs = self._start(new) if new else []
        experts = 0.0
        if running:
            spec_outputs, experts = self._iterate(running, t_step)
            outputs += spec_outputs
        for out in outputs:
            if out.finished:
                active = self._active[id(out.request)]
                self.engine.keep_prefix(out.request, active.cache, active.drafter)
                self.abort(out.request)
        return outputs, experts

    def _start(self, new: list[_Active]) -> list[BatchStepOutput]:
        """Prefill requests admitted since the last step, together in one forward (`prefill_batch`),
        and emit each one's first token (the same rule as `SpecEngine.run`)."""
        engine = self.engine
        t0 = time.perf_counter()
        prompts = [torch.tensor([a.request.prompt_ids], dtype=torch.int64, device=self.target.device) for a in new]
        for a in new:
            a.cache = self.target.new_cache()
        outputs = []
        for active, prompt, (prefill, drafter_prefix) in zip(new, prompts, self._prefill(new, prompts)):
            request = active.request
            engine.track(request, prefill)
            root = engine._first_token(prefill, request)
            active.drafter = RequestDrafter(engine.draft_source, LazyDraftStart(prompt, prefill, root, drafter_prefix),
                                            lazy=self._defer_drafter, constraint=draft_constraint(request))
            if engine.values is not None and engine.policy.uses_values:
                active.values = engine.values.for_request(request.sampling)
            finished = engine._append(request, [root], prefill.logits[0, -1:])
            outputs.append(BatchStepOutput(request, request.output_ids[-1:], finished, None))
        prefill_ms = (time.perf_counter() - t0) * 1e3  # every request waited for the whole prefill
        for active in new:
            active.request.prefill_ms = prefill_ms
        return outputs

    def _prefill(self, new: list[_Active], prompts: list[torch.Tensor]) -> list[tuple[TargetOutput, object]]:
        """The new requests' prompts and what their drafters may copy: those with a cached prefix (each
        forward covers only the rest of its prompt) or asking for prompt logprobs (every position's
        logits) one by one, the others together in one forward."""
        cached = self.engine.prefix_cache
        alone = [a.request.prompt_logprobs is not None
                 or (cached is not None and cached.match(a.request.prompt_ids)[0] is not None) for a in new]
        together = [b for b, one in enumerate(alone) if not one]
        outs: list[tuple | None] = [None] * len(new)
        if together:
            caches, batch = [new[b].cache for b in together], [prompts[b] for b in together]
            for b, out in zip(together, prefill_batch(self.target, caches, batch)):
                outs[b] = out, None
            if cached is not None:
                cached.misses += len(together)
        for b in (b for b, one in enumerate(alone) if one):
            outs[b] = self.engine.prefill_alone(new[b].request, new[b].cache, prompts[b])
        return outs

    def _iterate(self, running: list[_Active], t_step: float) -> tuple[list[BatchStepOutput], float]:
        engine = self.engine
        # The guard and the costs time the iteration alone: prefills of requests admitted in the same
        # step (a whole plain step's worth each) would otherwise land on whichever mode ran beside them.
        t_iter = time.perf_counter()
        greedy = all(a.request.sampling.greedy for a in running)
        guard = self.guard.of(greedy, (a.request for a in running)) if self.guard is not None else None
        speculate = guard.speculate(len(running), greedy=greedy) if guard is not None else engine.policy.drafts
        t0 = time.perf_counter()
        scouted = (not speculate and guard is not None and running[0].drafter.scouts
                   and guard.wants_scout(len(running), greedy))
        if scouted:
            # the drafters catch up on the skipped steps (which the next speculative step needs anyway), reading
            # whether each committed token was among their first guesses: speculate now where those say it pays
            hits = [hit for a in running for hit in a.drafter.scout(GREEDY_SCOUT_TOP)]
            speculate = guard.scout(len(running), hits, time.perf_counter() - t0, running[0].drafter.depth)
        if speculate:  # after plain steps: the switch's price, kept out of the guard's and costs' view of this step
            catch_up_all([a.drafter for a in running])
        t_switch = time.perf_counter() - t0
        drafts = self._draft(running) if speculate else [None] * len(running)
        t_draft = time.perf_counter() - t0
        t0 = time.perf_counter()
        drafts, valued = self._candidates(running, drafts) if speculate else (drafts, drafts)
        t_values = time.perf_counter() - t0
        t0 = time.perf_counter()
        predictions = [self._predict(a, d) for a, d in zip(running, drafts)] if speculate else [(None, None)] * len(running)
        t_pred = time.perf_counter() - t0
        t0 = time.perf_counter()
        node_idx = self._select(running, valued, predictions)
        roots = [token_tensor(a.request.output_ids[-1], self.target.device) for a in running]
        # on the device all requests' deepest selected depths come back in one transfer, and the layouts
        # then read nothing (on the CPU the layout's host path reads its lists anyway)
        if self.target.device.type == "cpu":  # verify the selected nodes only, not the policies' -1 padding
            node_idx, depths = [n if n is None else selected_columns(n) for n in node_idx], [None] * len(running)
        else:
            depths = _max_depths(drafts, node_idx)
        layouts = [build_layout(d.tree, n, r, depth) if d is not None else root_layout(r)
                   for d, n, r, depth in zip(drafts, node_idx, roots, depths)]
        t_select = time.perf_counter() - t0 + t_values  # the values rank the candidates and the selection
        t0 = time.perf_counter()
        outs = verify_batch(self.target, [a.cache for a in running], layouts)
        t_target = time.perf_counter() - t0
        batch_experts = _batch_unique_per_layer(outs, self.target.num_experts)
        t0 = time.perf_counter()
        # A plain step verifies every root with one call (the rule is per row, so each request's result
        # and random numbers are those of verifying it alone); a speculative one request by request.
        checked = _verify_roots(running, roots, outs) if not speculate else [None] * len(running)
        t_roots = (time.perf_counter() - t0) / len(running)
        results = [self._finish(a, d, experts, n, layout, out, result)
                   for a, d, (experts, _), n, layout, out, result
                   in zip(running, drafts, predictions, node_idx, layouts, outs, checked)]
        t0 = time.perf_counter()
        if speculate:  # the drafters take their accepted tokens in one packed forward (finished requests' need not)
            live = [b for b, r in enumerate(results) if not r.finished]
            if live:
                commit_all([running[b].drafter for b in live], [results[b].result for b in live], [outs[b] for b in live])
        else:  # a plain step: (bonus token, hidden of the root) waits for each drafter's next draft
            for a, r, out in zip(running, results, outs):
                a.drafter.defer(r.result, out)
        t_commit_drafts = (time.perf_counter() - t0) / len(running)
        iter_s = time.perf_counter() - t_iter - t_switch
        step_s = time.perf_counter() - t_step
        committed = sum(len(r.new_ids) for r in results)
        if guard is not None:
            guard.record(len(running), speculate, committed, iter_s, greedy=greedy)
        if self.costs is not None and speculate:
            k_total = sum(int(layout.num_nodes[0]) for layout in layouts)
            self.costs.record(len(running), k_total, _batch_unique_pairs(outs, self.target.num_experts), iter_s)
        # every request waited for the whole batch stage; a plain step after a scout ran its drafter catch-up
        shared = dict(predictor_ms=t_pred * 1e3, select_ms=t_select * 1e3, target_ms=t_target * 1e3,
                      step_ms=step_s * 1e3, scouted=scouted and not speculate)
        outputs = []
        for r in results:
            stats = StepStats(**r.parts, **shared, draft_ms=(t_draft + t_commit_drafts) * 1e3,
                              verify_ms=(t_target + t_roots + r.verify_s) * 1e3)
            r.request.steps.append(stats)
            outputs.append(BatchStepOutput(r.request, r.new_ids, r.finished, stats))
        return outputs, batch_experts

    # ------------------------------------------------------------------ stages
    def _draft(self, running: list[_Active]) -> list[Draft]:
        """Every request's draft, the drafter forwards of all of them packed together (`draft_all`;
        a lazily started drafter starts first), each cut to the depth its request can still emit."""
        requests = [a.request for a in running]
        drafts = draft_all([a.drafter for a in running], [r.prompt_ids + r.output_ids for r in requests],
                           self.target.device)
        return [Draft(d.tree_within(r.max_tokens - len(r.output_ids) - 1), d.drafted)
                for d, r in zip(drafts, requests)]

    def _candidates(self, running: list[_Active], drafts: list[Draft]) -> tuple[list[Draft], list[DraftTree]]:
        """Per request the draft cut to the nodes its policy chooses among (`SpecEngine.candidates`), and
        the same tree ranked on node values where the policy uses them (the layout is built on the
        drafted tree either way)."""
        cut, valued = [], []
        for active, draft in zip(running, drafts):
            context = active.request.prompt_ids + active.request.output_ids
            tree, ranked = self.engine.candidates(draft.tree, draft, context, active.values)
            cut.append(Draft(tree, draft.drafted))
            valued.append(ranked)
        return cut, valued

    def _predict(self, active: _Active, draft: Draft):
        request = active.request
        return self.engine._predict(request.prompt_ids + request.output_ids, draft.tree, draft, active.cache)

    def _select(self, running: list[_Active], valued: list[DraftTree | None], predictions) -> list[torch.Tensor]:
        """Per request the selected node list [1, K_b] (-1 pad) from its valued candidates."""
        if valued[0] is None:  # plain decoding step: every request verifies its root only
            return [torch.zeros(1, 0, dtype=torch.int64, device=self.target.device) for _ in running]
        if self._selects_as == "joint-batch":
            return self._joint_batch(valued, predictions)
        if self._selects_as == "evict-batch":
            return self._evict_batch(valued)
        if self._selects_as == "ecospec-batch":
            return self._ecospec_batch(valued, predictions)
        return [self.engine._select(v, e, rb, None).node_idx for v, (e, rb) in zip(valued, predictions)]

    def _joint_batch(self, trees: list[DraftTree], predictions) -> list[torch.Tensor]:
        budget = self.engine.tree.max_draft_tokens
        cost = self.costs.model(len(trees))
        sel = joint_batch_select(*_stack_trees(trees, predictions), cost, budget * len(trees), budget)
        return [sel.node_idx[b:b + 1] for b in range(len(trees))]

    def _ecospec_batch(self, trees: list[DraftTree], predictions) -> list[torch.Tensor]:
        policy = self.engine.policy
        sel = ecospec_batch_select(*_stack_trees(trees, predictions), policy.eps, policy.budget * len(trees),
                                   self.engine.tree.max_draft_tokens)
        return [sel.node_idx[b:b + 1] for b in range(len(trees))]

    def _evict_batch(self, trees: list[DraftTree]) -> list[torch.Tensor]:
        policy = self.engine.policy
        cap = policy.cost_table.max_nodes if policy.budget is None else min(policy.budget, policy.cost_table.max_nodes)
        # EVICT's per-request order: its top `cap` nodes by value (every prefix parent-closed), -1 after them
        orders = [top_k_nodes(t, cap) for t in trees]
        order = torch.cat(orders)
        scores = torch.cat([gather_nodes(t.scores, o, 0.0) for t, o in zip(trees, orders)])
        total = cap * len(trees)
        sel = evict_batch_select(order, scores, self.costs.table(len(trees), total), total)
        return [sel.node_idx[b:b + 1] for b in range(len(trees))]

    def _finish(self, active: _Active, draft: Draft | None, experts, node_idx: torch.Tensor, layout: TreeLayout,
                out: TargetOutput, result: VerifyResult | None = None):
        """Acceptance rule (unless `result` already holds it), commit and the step's own stats for one
        request (as `SpecEngine._step`; the drafter's commit follows for the whole batch in `_iterate`)."""
        request, engine = active.request, self.engine
        t0 = time.perf_counter()
        if result is None:
            result = engine.accept(request, layout, out.logits)
        t_verify = time.perf_counter() - t0
        if active.values is not None and draft is not None:  # the step's outcome updates the request's values
            active.values.observe(draft.tree, node_idx, accepted_nodes(node_idx, result.accepted_pos))
        t0 = time.perf_counter()
        engine.commit(request, active.cache, out, result)
        t_commit = time.perf_counter() - t0
        emitted = result.emitted_ids[0, : int(result.num_emitted[0])].tolist()
        before = len(request.output_ids)
        finished = engine._append(request, emitted, out.logits[0], result)
        hits, checked = _predictor_hits(experts, out, layout, result) if draft is not None else (0, 0)
        parts = dict(  # StepStats fields of this request alone; `_iterate` adds the batch stages' times
            speculated=draft is not None, verified_tokens=0 if draft is None else int(layout.num_nodes[0]),
            accepted_tokens=len(emitted) - 1, committed_tokens=len(emitted),
            unique_experts_per_layer=_unique_per_layer(out, self.target.num_experts),
            commit_ms=t_commit * 1e3, predictor_hits=hits, predictor_total=checked)
        return _Finished(request, request.output_ids[before:], finished, parts, result, t_verify)


def _max_depths(drafts: list[Draft | None], node_idx: list[torch.Tensor]) -> list[int | None]:
    """Per request the deepest selected depth (0: none selected; None: not drafted), all read back in
    one transfer: `build_layout` given it reads nothing (one sync per step, not several per request)."""
    live = [b for b, d in enumerate(drafts) if d is not None]
    depths: list[int | None] = [None] * len(drafts)
    if not live:
        return depths
    deepest = torch.stack([deepest_selected(drafts[b].tree, node_idx[b]) for b in live]).tolist()
    for b, depth in zip(live, deepest):
        depths[b] = depth
    return depths


def _verify_roots(running: list[_Active], roots: list[torch.Tensor], outs: list[TargetOutput]) -> list[VerifyResult]:
    """Every request's plain step (its root alone) verified in one call per kind, split per request:
    greedy requests together (no random numbers drawn, as alone), seeded ones together (each keyed by
    its seed and output position, as alone), unseeded ones together (each draws from its own
    generator, as alone)."""
    requests = [a.request for a in running]
    results: list[VerifyResult | None] = [None] * len(requests)
    greedy = [b for b, r in enumerate(requests) if r.sampling.greedy]
    seeded = [b for b, r in enumerate(requests) if not r.sampling.greedy and r.generator is not None]
    unseeded = [b for b, r in enumerate(requests) if not r.sampling.greedy and r.generator is None]
    for group in (greedy, seeded, unseeded):
        if not group:
            continue
        result = verify_tree(root_layout(torch.cat([roots[b] for b in group])),
                             torch.cat([processed_logits(requests[b], outs[b].logits, None) for b in group]),  # [G, 1, V]
                             [requests[b].sampling for b in group], [requests[b].generator for b in group],
                             seeds=position_keys([requests[b] for b in group]))
        for i, b in enumerate(group):
            results[b] = result.row(i)
    return results


@dataclass(frozen=True)
class _Finished:
    request: Request
    new_ids: list[int]
    finished: bool
    parts: dict  # the request's own StepStats fields (see `_finish`)
    result: VerifyResult  # its acceptance, for its drafter's commit
    verify_s: float  # its own acceptance rule (the batch's forward is added)


BATCH_POLICIES = {"joint-batch": "joint", "evict-batch": "evict", "ecospec-batch": "ecospec"}  # -> loaded policy


def _check_batch_policy(engine: SpecEngine, batch_policy: str | None) -> None:
    if batch_policy is None:
        return
    base = BATCH_POLICIES.get(batch_policy)
    if base is None:
        raise ValueError(f"unknown batch policy {batch_policy!r}; choose one of {', '.join(BATCH_POLICIES)}")
    if engine.policy.name != base:
        raise ValueError(f"{batch_policy} needs the model loaded with policy {base!r}, not {engine.policy.name!r}")
    if base in ("joint", "ecospec") and engine.policy.reads_experts and engine.predictor is None:
        raise ValueError(f"{batch_policy} needs an expert predictor (load the model with policy {base!r})")


def _default_costs(engine: SpecEngine, batch_policy: str | None) -> BatchCosts | BatchTableCosts | None:
    if batch_policy == "joint-batch":
        return BatchCosts(engine.policy.cost_model)
    if batch_policy == "evict-batch":
        return BatchTableCosts(engine.policy.cost_table)
    return None


def _stack_trees(trees: list[DraftTree], predictions) -> tuple[torch.Tensor, ...]:
    """(scores, parents, valid, path expert sets, root expert sets) of the requests, padded to the
    largest tree (pads invalid)."""
    N = max(t.num_nodes for t in trees)
    pad = lambda x, fill: torch.nn.functional.pad(x, (0, N - x.shape[1]), value=fill)  # noqa: E731
    scores = torch.cat([pad(t.scores, 0.0) for t in trees])
    parents = torch.cat([pad(t.parents, -1) for t in trees])
    valid = torch.cat([pad(t.valid, False) for t in trees])
    traj = torch.cat([torch.nn.functional.pad(path_bits(e.bits, t.parents, t.depth), (0, 0, 0, N - t.num_nodes))
                      for t, (e, _) in zip(trees, predictions)])
    root_bits = torch.cat([rb for _, rb in predictions])
    return scores, parents, valid, traj, root_bits


# ---------------------------------------------------------------------- the batched forwards
# Prompts prefilled together in one forward are right-padded to the longest; beyond this many
# padded tokens (B x longest) they are prefilled one by one (bounds the [B, T, T] attention masks).
MAX_BATCHED_PREFILL_TOKENS = 4096


def prefill_batch(target: TargetModel, caches: list[TargetCache], prompts: list[torch.Tensor]) -> list[TargetOutput]:
    """Prefill new requests' prompts [1, L_b] into their empty caches: one lean forward for all of
    them, each output as `TargetModel.prefill` gives it (logits of the last prompt token [1, 1, V],
    hidden and expert ids of every prompt token). Rows are right-padded to the longest prompt: a
    prompt's tokens see only themselves and earlier ones (causal), and the padding's keys, written
    past the prompt in its cache slot, are overwritten by the request's next forward before any
    query can see them. One by one without a lean forward, for a single prompt, or when padding
    would pass MAX_BATCHED_PREFILL_TOKENS."""
    lean = getattr(target, "lean", None)
    longest = max(p.shape[1] for p in prompts)
    if lean is None or len(prompts) == 1 or longest * len(prompts) > MAX_BATCHED_PREFILL_TOKENS:
        return [target.prefill(c, p) for c, p in zip(caches, prompts)]
    from ..models.lean_forward import ForwardBatch

    for c, p in zip(caches, prompts):
        target._check_ready(c, p)
        if c.num_tokens:
            raise ValueError("prefill_batch fills empty caches only")
    order = _slot_order(caches)
    device = target.device
    lengths = [prompts[b].shape[1] for b in order]
    input_ids = torch.zeros(len(order), longest, dtype=torch.int64, device=device)
    for row, b in enumerate(order):
        input_ids[row, :lengths[row]] = prompts[b][0].to(device)
    batch = ForwardBatch(input_ids=input_ids, positions=torch.arange(longest, device=device).expand(len(order), longest),
                         slots=tuple(caches[b].slot for b in order), prefix_lens=(0,) * len(order),
                         logits_at=tuple(n - 1 for n in lengths))
    out = lean.forward(caches[0].kv, batch)
    for b, n in zip(order, lengths):
        caches[b].num_tokens = n
    return _per_request(out, order, lengths, all_logits=False)


def verify_batch(target: TargetModel, caches: list[TargetCache], layouts: list[TreeLayout]) -> list[TargetOutput]:
    """One target forward over every request's root + selected nodes; per-request outputs
    [1, 1+K_b, ...] at its own layout positions. Falls back to one forward per request when
    the target has no lean (static-cache) forward."""
    lean = getattr(target, "lean", None)
    if lean is None or len(layouts) == 1:
        return [target.verify(c, layout) for c, layout in zip(caches, layouts)]
    from ..models.lean_forward import ForwardBatch

    for c, layout in zip(caches, layouts):  # token values checked on the CPU only (a read back: a sync on CUDA)
        target._check_ready(c, layout.token_ids, check_values=target.device.type == "cpu")
    order = _slot_order(caches)
    caches, layouts = [caches[b] for b in order], [layouts[b] for b in order]
    prefix_lens = tuple(c.num_tokens for c in caches)
    if all(layout.num_positions == 1 for layout in layouts):  # a plain batch: the roots at their positions
        input_ids = torch.cat([layout.token_ids for layout in layouts])
        positions, tree_mask = host_tensor(prefix_lens, input_ids.device)[:, None], None
    else:
        stacked = pad_layouts(layouts)
        input_ids, positions = stacked.token_ids, stacked.position_ids(host_tensor(prefix_lens, stacked.token_ids.device))
        tree_mask = stacked.tree_mask()
    batch = ForwardBatch(input_ids=input_ids.to(target.device), positions=positions.to(target.device),
                         slots=tuple(c.slot for c in caches), prefix_lens=prefix_lens,
                         tree_mask=None if tree_mask is None else tree_mask.to(target.device), logits_to_keep=0)
    out = lean.forward(caches[0].kv, batch)
    for c, layout in zip(caches, layouts):
        c.num_pending = layout.num_positions
    return _per_request(out, order, [layout.num_positions for layout in layouts], all_logits=True)


def _slot_order(caches: list[TargetCache]) -> list[int]:
    """The requests in the order of their cache slots, the order a batched forward runs its rows in:
    a consecutive block of slots is then read as one view of the cache instead of a gather of every
    request's K/V (see `StaticKVCache.acquire`)."""
    return sorted(range(len(caches)), key=lambda b: caches[b].slot)


def _per_request(out, order: list[int], lengths: list[int], all_logits: bool) -> list[TargetOutput]:
    """A batched forward's rows (row i = request order[i], its first lengths[i] positions real) as
    each request's own output, in the callers' order; logits at every position or the one kept."""
    outputs: list[TargetOutput | None] = [None] * len(order)
    for row, (b, n) in enumerate(zip(order, lengths)):
        outputs[b] = TargetOutput(logits=out.logits[row:row + 1, :n] if all_logits else out.logits[row:row + 1],
                                  hidden=out.hidden[row:row + 1, :n], expert_ids=out.expert_ids[row:row + 1, :n])
    return outputs


def pad_layouts(layouts: list[TreeLayout]) -> TreeLayout:
    """Stack single-request layouts [1, 1+K_b] into one [B, 1+K_max]; pads repeat the root token
    at depth 0 and are invalid, so each sees only its root (and computes the root again)."""
    T = max(layout.num_positions for layout in layouts)
    D = max(layout.paths.shape[2] for layout in layouts)

    def pad(x: torch.Tensor, fill, width: int) -> torch.Tensor:
        return torch.nn.functional.pad(x, (0, width - x.shape[-1]), value=fill)

    return TreeLayout(
        node_idx=torch.cat([pad(layout.node_idx, -1, T - 1) for layout in layouts]),
        token_ids=torch.cat([torch.cat([layout.token_ids, layout.token_ids[:, :1].expand(1, T - layout.num_positions)], 1)
                             for layout in layouts]),
        depth=torch.cat([pad(layout.depth, 0, T) for layout in layouts]),
        parent_pos=torch.cat([pad(layout.parent_pos, -1, T) for layout in layouts]),
        valid=torch.cat([pad(layout.valid, False, T) for layout in layouts]),
        paths=torch.cat([torch.nn.functional.pad(layout.paths, (0, D - layout.paths.shape[2], 0, T - layout.num_positions),
                                                 value=-1) for layout in layouts]),
        num_nodes=torch.cat([layout.num_nodes for layout in layouts]),
    )


def _batch_unique_pairs(outs: list[TargetOutput], num_experts: int) -> int:
    """(layer, expert) pairs the whole batch's verify forward woke."""
    ids = torch.cat([o.expert_ids[0] for o in outs])  # [sum T_b, L, topk]
    L = ids.shape[1]
    onehot = torch.zeros(L, num_experts, dtype=torch.bool, device=ids.device)
    onehot.scatter_(1, ids.permute(1, 0, 2).reshape(L, -1), True)
    return int(onehot.sum())


def _batch_unique_per_layer(outs: list[TargetOutput], num_experts: int) -> float:
    return _batch_unique_pairs(outs, num_experts) / outs[0].expert_ids.shape[2]
