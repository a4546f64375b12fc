"""Draft sources the engine can run: EAGLE-3, n-gram lookup, or none (plain decoding).

Each keeps its per-request state in an object the engine passes back on every call,
so one loaded model can serve many requests.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable

import torch

from ..core.tree import DraftTree, limit_depth
from ..core.verify import VerifyResult
from ..models.cuda_graphs import GraphCaptureError, warn_fallback
from ..models.eagle3.drafting import Eagle3Draft, draft_eagle3_tree, draft_eagle3_trees
from ..models.target import TargetOutput

if TYPE_CHECKING:
    from .prefix_cache import DrafterPrefix


@dataclass(frozen=True)
class Draft:
    tree: DraftTree  # [1, N] the drafted tree (the drafter's, or cut from it with the same N columns)
    drafted: Eagle3Draft | None = None  # what the EAGLE-3 drafter returned, whose features are read on demand

    @property
    def node_hidden(self) -> torch.Tensor | None:
        """[1, N, H] drafter features per node (EAGLE-3), else None; made when a predictor first reads them."""
        return None if self.drafted is None else self.drafted.node_hidden

    def tree_within(self, max_depth: int) -> DraftTree:
        """The tree without its nodes deeper than max_depth (`limit_depth`): as it is, without reading its
        depths, when the drafter ran too few forwards to reach past max_depth."""
        if self.drafted is not None and self.drafted.num_forwards + 1 <= max_depth:
            return self.tree
        return limit_depth(self.tree, max_depth)


class NoDraft:
    """Plain decoding: every step verifies only the root."""

    name = "none"
    reads_target_features = False  # start() ignores the prompt's capture hiddens

    def start(self, prompt_ids: torch.Tensor, prefill: TargetOutput, root: int, prefix=None) -> None:
        return None

    def draft(self, state: Any, context: list[int], device: torch.device) -> Draft:
        return Draft(DraftTree.empty(1, device=device), None)

    def commit(self, state: Any, result: VerifyResult, verify: TargetOutput) -> None:
        return None

    def defer(self, state: Any, result: VerifyResult, root_hidden: torch.Tensor) -> None:
        return None

    def catch_up(self, states: list) -> None:
        return None


# Plain steps a lazily started drafter may miss before it is started anyway. Each kept step holds its
# root position's capture hidden (3 KB on moespec-tiny) and its result, so the wait is bounded; a
# request this long pays the drafter's prompt prefill once, as it would without the wait, amortised
# over hundreds of tokens.
MAX_PENDING_STEPS = 256


class LazyDraftStart:
    """A request's drafter started only when the request first speculates (the goodput guard may
    never let it): until then the prompt's prefill and the plain steps since are kept and replayed
    at the start (the prefill's drafter forward, then the plain steps deferred: the drafter catches
    up on them in one forward when it drafts). A request that never speculates runs no drafter
    forward at all."""

    def __init__(self, prompt_ids: torch.Tensor, prefill: TargetOutput, root: int,
                 prefix: "DrafterPrefix | None" = None):
        self.prompt_ids, self.prefill, self.root, self.prefix = prompt_ids, prefill, root, prefix
        self.plain_steps: list[tuple[VerifyResult, torch.Tensor]] = []

    def add(self, result: VerifyResult, root_hidden: torch.Tensor) -> bool:
        """Keep a plain step; True when the wait is full and the drafter should start now."""
        # Copied: a batched forward's rows are views of one tensor, and a CUDA graph's outputs are
        # overwritten by its next replay.
        self.plain_steps.append((result, root_hidden.clone()))
        return len(self.plain_steps) >= MAX_PENDING_STEPS

    def start(self, source) -> Any:
        """The source's per-request state, as if it had started at the prefill and deferred every kept step."""
        state = source.start(self.prompt_ids, self.prefill, self.root, self.prefix)
        for result, root_hidden in self.plain_steps:
            source.defer(state, result, root_hidden)
        self.plain_steps = []
        return state


class Eagle3Source:
    """EAGLE-3 drafting with (steps, topk), the optional DDD stop rule and an optional
    cost-aware stop rule (`core.drafting.DraftStopRule`)."""

    name = "eagle3"
    reads_target_features = True  # start() prefills the drafter from the prompt's capture hiddens

    def __init__(self, drafter, steps: int, topk: int, ddd_threshold: float | None = None, stop_rule=None,
                 extend_runner=None, frontier_runner=None):
        self.drafter, self.steps, self.topk, self.ddd_threshold = drafter, steps, topk, ddd_threshold
        self.stop_rule = stop_rule
        # Optional `models.cuda_graphs.StaticDrafterExtend` / `DrafterGraphs`: the drafter forward over
        # each step's committed tokens as a static-shape forward (CUDA: a graph per length bucket).
        # None: `Eagle3Drafter.commit` / `extend` (the CPU path).
        self.extend_runner = extend_runner
        # Optional `models.cuda_graphs.StaticDrafterFrontier` / `DrafterFrontierGraphs`: the tree-drafting
        # forwards (one per drafting step, the frontier padded to topk rows; CUDA: one graph).
        # None: `Eagle3Drafter.draft_tree` as is (the CPU path).
        self.frontier_runner = frontier_runner
        # Feed padded frontiers instead of reading their length back (eagle3_draft's module doc).
        # None: off the CPU, where the read is a device sync.
        self.sync_free: bool | None = None

    def start(self, prompt_ids: torch.Tensor, prefill: TargetOutput, root: int,
              prefix: "DrafterPrefix | None" = None) -> "Eagle3State":
        """A request's drafter state: its cache prefilled with the prompt (drafter position t pairs the
        target hidden at t with token t+1, the root after the last). With a `prefix` (a kept request's
        drafter cache whose first positions the prompt shares) those positions are copied, not recomputed."""
        cache = self.drafter.new_cache()
        if prefix is None:
            self.drafter.prefill(cache, prompt_ids, prefill.hidden, next_token=root)
            return Eagle3State(cache)
        k = prefix.length
        self.drafter.copy_prefix(cache, prefix.cache, k)
        shifted = torch.cat([prompt_ids[:, 1:], prompt_ids.new_tensor([[int(root)]])], dim=1)
        self.drafter.extend(cache, shifted[:, k:], prefill.hidden[:, k:])
        return Eagle3State(cache)

    def draft(self, state: "Eagle3State", context: list[int], device: torch.device) -> Draft:
        self.catch_up([state])
        expand = self._expand_rule(state)
        if self.frontier_runner is None:
            out = self.drafter.draft_tree(state.cache, self.steps, self.topk, self.ddd_threshold, expand,
                                          state.constraint, self.sync_free)
        else:
            out = self._draft_static(state.cache, expand, state.constraint)
        return Draft(out.tree, out)

    def draft_batch(self, states: list["Eagle3State"], contexts: list[list[int]], device: torch.device) -> list[Draft]:
        """`draft` for a batch's requests with their drafter forwards packed: one catch-up forward, then
        one forward per drafting step for all of them (`draft_eagle3_trees`). With a static frontier runner
        (CUDA graphs of one request's frontier), request by request."""
        if self.frontier_runner is not None or len(states) == 1:
            return [self.draft(s, c, device) for s, c in zip(states, contexts)]
        self.catch_up(states)
        outs = draft_eagle3_trees(self.drafter, [s.cache for s in states], self.steps, self.topk, self.ddd_threshold,
                                  [self._expand_rule(s) for s in states], constraints=[s.constraint for s in states],
                                  sync_free=self.sync_free)
        return [Draft(out.tree, out) for out in outs]

    def _expand_rule(self, state: "Eagle3State") -> Callable[[DraftTree, torch.Tensor], bool] | None:
        rule = self.stop_rule
        if rule is not None and state.node_values is not None:
            rule = replace(rule, values=state.node_values)  # rank the frontier on this request's values
        return None if rule is None else _should_expand(rule)

    def _draft_static(self, cache, expand, constraint):
        """Draft through the frontier runner; if its graph cannot be captured, warn once, drop it and
        draft eagerly (drafting never changes the committed cache, so starting over is exact)."""
        try:
            return draft_eagle3_tree(self.drafter, cache, self.steps, self.topk, self.ddd_threshold, expand,
                                     frontier_runner=self.frontier_runner, constraint=constraint,
                                     sync_free=self.sync_free)
        except GraphCaptureError as e:
            warn_fallback(e.__cause__ or e, "drafter's tree-drafting forward")
            self.frontier_runner = None
            return self.drafter.draft_tree(cache, self.steps, self.topk, self.ddd_threshold, expand, constraint,
                                           self.sync_free)

    def commit(self, state: "Eagle3State", result: VerifyResult, verify: TargetOutput) -> None:
        self.commit_batch([state], [result], [verify])

    def commit_batch(self, states: list["Eagle3State"], results: list[VerifyResult], verifies: list[TargetOutput]) -> None:
        """Append each request's accepted tokens and bonus token to its drafter cache: one packed
        forward for all of them (without a static extension runner)."""
        self.catch_up(states)
        pairs = [self.drafter.commit_pairs(r.accepted_pos[0], r.emitted_ids[0], v.hidden) for r, v in zip(results, verifies)]
        self._extend_all([s.cache for s in states], [ids for ids, _ in pairs], [hidden for _, hidden in pairs])

    def _extend_all(self, caches: list, token_ids: list[torch.Tensor], target_hidden: list[torch.Tensor]) -> None:
        if self.extend_runner is None and len(caches) > 1:
            self.drafter.extend_packed(caches, token_ids, target_hidden)
            return
        for cache, ids, hidden in zip(caches, token_ids, target_hidden):
            self._extend(cache, ids, hidden)

    def _extend(self, cache, token_ids: torch.Tensor, target_hidden: torch.Tensor,
                top: int = 0) -> torch.Tensor | None:
        """Append drafter positions through the static runner when the extension fits its buckets (with
        `top` > 0: each new position's `top` most likely next tokens, [n, top], as `Eagle3Drafter.extend`
        gives them)."""
        runner, drafter = self.extend_runner, self.drafter
        token_ids = token_ids.to(drafter.lm_head.weight.device)
        n = token_ids.shape[1]
        if runner is None or n == 0 or n > runner.max_tokens or cache.kv is None:
            return drafter.extend(cache, token_ids, target_hidden, top)
        S, a = cache.num_tokens, drafter.midlayer.self_attn
        kv = cache.reserve(S + runner.bucket(n), a.num_kv_heads, a.head_dim, drafter.lm_head.weight.dtype,
                           drafter.lm_head.weight.device)
        try:
            out = runner.run(kv, S, token_ids, target_hidden)
        except GraphCaptureError as e:
            # the warm-ups wrote at most these positions' keys, which the eager extension rewrites
            warn_fallback(e.__cause__ or e, "drafter's extension forward")
            self.extend_runner = None
            return drafter.extend(cache, token_ids, target_hidden, top)
        cache.num_tokens = S + n
        cache.last_logits, cache.last_hidden = out.logits[:, -1], out.hidden[:, -1]
        return drafter.top_target_ids(out.logits[0], top) if top else None

    def defer(self, state: "Eagle3State", result: VerifyResult, root_hidden: torch.Tensor) -> None:
        """A plain step (nothing drafted, root only verified): remember (bonus token, root hidden
        [1, 1, 3H]) instead of running a drafter forward now; the next draft extends by all of them in
        one forward."""
        if int(result.num_accepted[0]) != 0:
            raise ValueError("defer() is for plain steps: nothing may have been accepted")
        state.pending_ids.append(result.emitted_ids[0, :1])  # [1]
        state.pending_hidden.append(root_hidden[0])  # [1, 3H] the root position

    def catch_up(self, states: list["Eagle3State"]) -> None:
        """Feed the requests' deferred plain steps to their drafter caches (one forward for all; a no-op
        for those with none). `draft` does it anyway; the engines call it first to time it apart."""
        behind = [s for s in states if s.pending_ids]
        if not behind:
            return
        pending = [s.take_pending() for s in behind]
        self._extend_all([s.cache for s in behind], [ids[None] for ids, _ in pending],
                         [hidden[None] for _, hidden in pending])

    def first_guess(self, state: "Eagle3State") -> int | None:
        """The drafter's most likely next token (target id) after its committed positions: the top
        depth-1 draft of the next tree (unconstrained by the request's grammar). None before the drafter's
        first forward (a cache that copied a whole prompt from the prefix cache)."""
        logits = state.cache.last_logits
        return None if logits is None else int(self.drafter.top1_target_ids(logits)[0])

    def scout(self, state: "Eagle3State", top: int = 1) -> list[bool]:
        """`catch_up` for one request, reading what a depth-1 draft would have done at each plain step it
        skipped: hits[i] is whether the token the target committed there was among the drafter's `top`
        first guesses (its guesses before the step, then at each caught-up position). With top = 1: a
        deterministic draft d is accepted with probability p(d) (core/verify.py), and 1[x == d] with x the
        target's committed token is an unbiased sample of it at any temperature: the shadow of speculating,
        for no target forward. Greedy scouts read the top 2 (engine/guard.py `GREEDY_SCOUT_TOP`)."""
        if not state.pending_ids:
            return []
        logits = state.cache.last_logits
        before = None if logits is None else self.drafter.top_target_ids(logits, top)[0].tolist()
        ids, hidden = state.take_pending()  # the skipped steps' committed tokens [n] and root hiddens [n, 3H]
        after = self._extend(state.cache, ids[None], hidden[None], top=top).tolist()  # guesses of ids[1:], the next
        guesses = ([] if before is None else [before]) + after[:-1]
        return [t in g for g, t in zip(guesses, ids.tolist()[len(ids) - len(guesses):])]


def _should_expand(rule) -> Callable[[DraftTree, torch.Tensor], bool]:
    """The drafter's `should_expand(tree, frontier [F])` hook from a core.drafting stop rule."""

    def should_expand(tree: DraftTree, frontier: torch.Tensor) -> bool:
        # the rule is host code: a device tree is read back once for all of it
        tree, frontier = tree.on_host(), frontier.cpu()
        num_forwards = int(tree.depth[0, frontier].max()) - 1  # a depth-d frontier took d - 1 forwards
        return not bool(rule(tree, frontier[None], num_forwards)[0])

    return should_expand


@dataclass
class Eagle3State:
    """Per-request drafter state: the drafter cache plus plain steps not yet fed to it."""

    cache: Any  # models.eagle3.Eagle3Cache
    pending_ids: list[torch.Tensor] = field(default_factory=list)  # [1] bonus token of each deferred plain step
    pending_hidden: list[torch.Tensor] = field(default_factory=list)  # [1, 3H] target capture hidden at its root
    node_values: Callable[[DraftTree], torch.Tensor] | None = None  # the request's node values, for the stop rule
    constraint: Callable[[list[list[int]]], torch.Tensor] | None = None  # its grammar's allowed tokens after paths

    def take_pending(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The deferred plain steps, emptied: their bonus tokens [n] and root capture hiddens [n, 3H]."""
        ids, hidden = torch.cat(self.pending_ids), torch.cat(self.pending_hidden)
        self.pending_ids.clear()
        self.pending_hidden.clear()
        return ids, hidden


class NgramSource:
    """Weightless prompt-lookup drafting (the EVICT paper's Lookahead baseline)."""

    name = "ngram"
    reads_target_features = False

    def __init__(self, drafter):
        self.drafter = drafter

    def start(self, prompt_ids: torch.Tensor, prefill: TargetOutput, root: int, prefix=None) -> None:
        return None

    def draft(self, state, context: list[int], device: torch.device) -> Draft:
        return Draft(self.drafter.draft_tree(torch.tensor(context, device=device)), None)

    def commit(self, state, result: VerifyResult, verify: TargetOutput) -> None:
        return None

    def defer(self, state, result: VerifyResult, root_hidden: torch.Tensor) -> None:
        return None  # prompt lookup reads the context: nothing to catch up

    def catch_up(self, states: list) -> None:
        return None


def catch_up_all(drafters: list["RequestDrafter"]) -> None:
    """Bring every request's drafter up to date before drafting: start those not started yet (the
    prompt's drafter prefill, lazily under a guard) and feed them the plain steps they skipped, in one
    forward. The price of switching from plain decoding to speculation, paid once per switch: the
    engines time it apart from the speculative step it precedes, so a guard's probe is judged on what
    speculating costs from then on."""
    for d in drafters:
        d._start()
    drafters[0].source.catch_up([d.state for d in drafters])


def draft_all(drafters: list["RequestDrafter"], contexts: list[list[int]], device: torch.device) -> list[Draft]:
    """Every request's draft (a batch step's; all share one source): in one call when the source
    drafts a batch together (`draft_batch`), else request by request."""
    for d in drafters:
        d._start()
    source = drafters[0].source
    if hasattr(source, "draft_batch"):
        return source.draft_batch([d.state for d in drafters], contexts, device)
    return [source.draft(d.state, c, device) for d, c in zip(drafters, contexts)]


def commit_all(drafters: list["RequestDrafter"], results: list[VerifyResult], verifies: list[TargetOutput]) -> None:
    """Every request's drafter commit after a batch's speculative step, together when the source can."""
    source = drafters[0].source
    if hasattr(source, "commit_batch"):
        source.commit_batch([d.state for d in drafters], results, verifies)
        return
    for d, result, verify in zip(drafters, results, verifies):
        d.commit(result, verify)


class RequestDrafter:
    """One request's draft source and state, started at once or (`lazy`, under a goodput guard) at the
    request's first speculative step; plain steps are deferred to the drafter (or kept until it starts)."""

    def __init__(self, source, pending: LazyDraftStart, lazy: bool,
                 constraint: Callable[[list[list[int]]], torch.Tensor] | None = None):
        self.source, self.pending, self.node_values = source, pending, None
        self.constraint = constraint  # the request's grammar's allowed tokens, for drafting (engine/structured.py)
        self.state = None
        if not lazy:
            self._start()

    def _start(self) -> None:
        if self.pending is not None:
            self.state, self.pending = self.pending.start(self.source), None
            if isinstance(self.state, Eagle3State):
                self.state.node_values, self.state.constraint = self.node_values, self.constraint

    def catch_up(self) -> None:
        """`catch_up_all` for this request alone."""
        catch_up_all([self])

    @property
    def scouts(self) -> bool:
        """Can this drafter read its guesses at skipped plain steps (`scout`)? EAGLE-3 can; n-gram lookup
        and plain decoding cannot."""
        return hasattr(self.source, "scout")

    def scout(self, top: int = 1) -> list[bool]:
        """Catch up on the skipped plain steps (starting the drafter if need be) and return whether the
        committed token was among its `top` first guesses at each (`Eagle3Source.scout`)."""
        self._start()
        return self.source.scout(self.state, top)

    @property
    def depth(self) -> int:
        """The deepest draft this source proposes (its drafting steps; 0: unknown)."""
        return int(getattr(self.source, "steps", 0))

    def first_guess(self) -> int | None:
        """The drafter's top depth-1 guess for the next token (None: a source without one)."""
        return self.source.first_guess(self.state) if self.scouts and self.state is not None else None

    def draft(self, context: list[int], device: torch.device) -> Draft:
        self._start()
        return self.source.draft(self.state, context, device)

    def kept_cache(self):
        """The drafter cache a finished request leaves to the prefix cache (None: never started, or a
        source without one)."""
        return getattr(self.state, "cache", None)

    def commit(self, result: VerifyResult, verify: TargetOutput) -> None:
        self.source.commit(self.state, result, verify)

    def defer(self, result: VerifyResult, verify: TargetOutput) -> None:
        """A plain step: the source keeps (bonus token, root hidden) to catch up on when it next drafts."""
        root_hidden = verify.hidden[:, :1]  # [1, 1, 3H]: all a plain step verified
        if self.pending is None:
            self.source.defer(self.state, result, root_hidden)
        elif self.pending.add(result, root_hidden):
            self._start()
