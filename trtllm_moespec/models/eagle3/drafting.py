"""EAGLE-3 tree drafting with (steps, topk), on tensors (EAGLE-2/3 dynamic tree).

Step 1 takes the drafter's top-`topk` tokens at the root (the output of the last
committed drafter position). Each later step runs ONE drafter forward over the
current frontier: a frontier node v feeds (embed(token v), pre-norm hidden of the
forward that proposed v) at position `S - 1 + depth(v)`, attending to the whole
drafter prefix, to its already-drafted ancestors and to itself (a tree mask). Its
top-`topk` children are added via `core.TreeBuffer.grow` (`core.grow_tree` in place), which
keeps every child in the tree and makes the top-`topk` by score the next frontier. DDD's dynamic-depth rule
(`core.ddd_should_stop`) may end drafting early. Tree keys are kept outside the
drafter cache, so drafting never changes the cache: it always holds exactly the
committed tokens.

With a `frontier_runner` each step's forward runs through the static-shape drafter forward
(`graphs.py` `StaticDrafterFrontier`; on CUDA one captured graph, `DrafterFrontierGraphs`):
the frontier padded to the runner's width, attending over the whole drafter buffer. Without one
(the default, and the CPU engine's path) it is `Eagle3Drafter.forward` over exactly F rows.

Off the CPU, a tree drafted with no stop rule, no DDD and no constraint reads nothing back from the
device (`sync_free`): how many frontier entries are real (-1 pads trail when children score 0) is a
device-to-host read that would stall the host until the forward before it has run, three times a
step. The frontier is fed as it is, all `topk` rows; a pad row computes the features of node 0
again in its own key slot, which no real node sees, and grows only invalid children. The valid
nodes are those the host-read path drafts; the tree just keeps more invalid ones.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import numpy as np
import torch

from ...core.policies import ddd_should_stop
from ...core.tree import DraftTree, TreeBuffer
from .fused_step import fused_grow_step
from .types import PackedSegment
from .workspace import DraftWorkspace

if TYPE_CHECKING:
    from .cache import Eagle3Cache
    from .graphs import StaticDrafterFrontier
    from .modeling import Eagle3Drafter


@dataclass(frozen=True)
class Eagle3Draft:
    """A drafted tree plus per-node drafter features."""

    tree: DraftTree
    # [1, R, H] pre-norm drafter hidden of each forward row that proposed children (the root's first, then each
    # expanded node's in order): every row proposes `topk` children, so node v's features are row v // topk's
    row_hidden: torch.Tensor
    topk: int
    num_forwards: int  # drafter forwards run (steps - 1 unless DDD stopped early)

    @functools.cached_property
    def node_hidden(self) -> torch.Tensor:
        """[1, N, H] the features of the forward that proposed each node (made when first read: most policies
        never read them, and a copy per node is ~8x the rows')."""
        return self.row_hidden.repeat_interleave(self.topk, dim=1)[:, :self.tree.num_nodes]


ExpandRule = Callable[[DraftTree, torch.Tensor], bool]  # (tree so far, frontier node idx [F]) -> expand it?
# (token paths after the committed output, one per row; draft logits [rows, V_draft]; the target id of
# each draft column [V_draft]) -> processed logits: a request's logit rules and grammar applied to its
# drafter (engine.draft_constraint), so it proposes what the target will verify with. Acceptance is unchanged.
DraftConstraint = Callable[[list[list[int]], torch.Tensor, torch.Tensor], torch.Tensor]
_DEAD = -1e29  # a row whose every logit is below this allows no token (banned logits are -1e30)


@torch.no_grad()
def draft_eagle3_tree(
    drafter: "Eagle3Drafter",
    cache: "Eagle3Cache",
    steps: int,
    topk: int,
    ddd_threshold: float | None = None,
    should_expand: ExpandRule | None = None,
    frontier_runner: "StaticDrafterFrontier | None" = None,
    constraint: DraftConstraint | None = None,
    sync_free: bool | None = None,
) -> Eagle3Draft:
    """Draft a tree of up to topk + (steps-1)*topk^2 nodes after the committed positions of `cache`.

    Before each later step, drafting stops when DDD's rule fires (`ddd_threshold`) or when
    `should_expand(tree, frontier)` returns False: the per-step "expand further?" decision a
    stop rule plugs in here. `frontier_runner` (`graphs.StaticDrafterFrontier`, or its
    CUDA graph `DrafterFrontierGraphs`) runs each step's forward with static shapes instead of
    `Eagle3Drafter.forward`; the tree and everything around the forward stay the same. With a
    `constraint` every node's children are drawn from the tokens it allows after the node's path.
    `sync_free` (None: off the CPU) feeds padded frontiers instead of reading their length (module doc).
    """
    return draft_eagle3_trees(drafter, [cache], steps, topk, ddd_threshold, [should_expand], frontier_runner,
                              [constraint], sync_free)[0]


@torch.no_grad()
def draft_eagle3_trees(
    drafter: "Eagle3Drafter",
    caches: "list[Eagle3Cache]",
    steps: int,
    topk: int,
    ddd_threshold: float | None = None,
    should_expand: "list[ExpandRule | None] | None" = None,
    frontier_runner: "StaticDrafterFrontier | None" = None,
    constraints: "list[DraftConstraint | None] | None" = None,
    sync_free: bool | None = None,
) -> list[Eagle3Draft]:
    """`draft_eagle3_tree` for several requests in lockstep: each drafting step runs ONE drafter
    forward over every still-expanding request's frontier (`Eagle3Drafter.forward_packed`), and
    one softmax/top-k over all their rows, instead of one of each per request. Each request keeps
    its own tree, masks, stop rule (`should_expand[b]`) and key slots in its own buffer; a request
    that stops expanding drops out of the later steps. A static `frontier_runner` drafts one request."""
    if steps < 1 or topk < 1:
        raise ValueError(f"steps and topk must be >= 1, got steps={steps}, topk={topk}")
    if frontier_runner is not None and len(caches) != 1:
        raise ValueError("a static frontier runner drafts one request at a time")
    topk = min(topk, drafter.config.draft_vocab_size)
    # a static runner pads the last frontier to its width: room for the padded rows' keys too
    pad = 0 if frontier_runner is None else max(frontier_runner.width - topk, 0)
    constraints = constraints if constraints is not None else [None] * len(caches)
    rules = should_expand if should_expand is not None else [None] * len(caches)
    if sync_free is None:
        sync_free = drafter.lm_head.weight.device.type != "cpu"
    # a rule that decides on the host reads the frontier anyway: only trees drafted without one skip the read
    trees = [_TreeDraft(drafter, cache, steps, topk, pad, c,
                        padded=sync_free and c is None and rule is None and ddd_threshold is None)
             for cache, c, rule in zip(caches, constraints, rules)]
    for step in range(steps - 1):
        active = [t for t, rule in zip(trees, rules) if t.expands(ddd_threshold, rule)]
        if not active:
            break
        if len(active) > 1:
            hidden, ids = zip(*(t.inputs() for t in active))
            out = drafter.forward_packed(torch.cat(hidden, dim=1), torch.cat(ids, dim=1),
                                         torch.cat([t.position_ids(step) for t in active], dim=1),
                                         [t.segment() for t in active])
        elif frontier_runner is None:
            t = active[0]
            hidden, ids = t.inputs()
            # forward itself: Module.__call__'s hook bookkeeping costs ~15 us a call in a CPU step (issue 25)
            out = drafter.forward(hidden, input_ids=ids, position_ids=t.position_ids(step),
                                  attention_mask=t.mask(), cache_kv=t.kv, cache_start=t.start + t.num_slots)
        else:  # the same forward, padded to the runner's width (CUDA: a graph replay)
            t = active[0]
            out = frontier_runner.run(t.kv, *t.inputs(), t.start + step, t.start + t.num_slots, t.mask())
        logits, row = out.logits, 0
        for t in active:  # a constrained request's rows: only the tokens its grammar allows
            if t.constraint is not None:
                logits = logits.clone() if logits is out.logits else logits
                logits[:, row:row + t.width] = t.constrained(logits[:, row:row + t.width], t.f)
            row += t.width
        probs = torch.softmax(logits.float(), dim=-1)  # [1, sum F, V_draft]: one softmax for all rows
        if len(active) == 1:
            active[0].grow(probs, out.hidden)
            continue
        row = 0
        for t in active:
            rows = slice(row, row + t.width)
            t.grow(probs[:, rows], out.hidden[:, rows])
            row += t.width
    return [t.result() for t in trees]


class _TreeDraft:
    """One request's tree while it is drafted: its nodes, masks, per-node hiddens and frontier.

    Frontier node v feeds (embed(token v), hidden of the forward that proposed v) at position
    `S - 1 + depth(v)`, and its key goes to the next free tree slot after the S committed keys.
    """

    def __init__(self, drafter: "Eagle3Drafter", cache: "Eagle3Cache", steps: int, topk: int, pad: int,
                 constraint: DraftConstraint | None = None, padded: bool = False):
        if cache.last_logits is None:
            raise ValueError("the drafter cache is empty: call prefill()/extend() before draft_tree()")
        self.drafter, self.topk, self.start = drafter, topk, cache.num_tokens
        attn = drafter.midlayer.self_attn
        max_slots = (steps - 1) * topk  # tree keys: one per expanded node, written after the committed ones
        self.kv = cache.reserve(self.start + max_slots + pad, attn.num_kv_heads, attn.head_dim,
                                cache.last_hidden.dtype, cache.last_hidden.device)
        device, capacity = self.kv.device, topk + max_slots * topk
        self.constraint = constraint
        self.alive: torch.Tensor | None = None  # [F] False: the constraint allows no draft token after the node
        self.num_slots = self.num_forwards = 0
        root_logits = cache.last_logits[:, None]  # [1, 1, V_draft]
        if constraint is not None:
            root_logits = self.constrained(root_logits, None)
        root_probs = torch.softmax(root_logits.float(), dim=-1)  # [1, 1, V_draft]
        H, forwards = cache.last_hidden.shape[-1], max(steps - 1, 0)
        # CPU, float32, no grammar: each step's bookkeeping in one compiled call (fused_step.py), in buffers
        # the request's drafter cache keeps between steps (workspace.py)
        fusable = (constraint is None and not padded and device.type == "cpu"
                   and cache.last_hidden.dtype == torch.float32 and self.kv.dtype == torch.float32)
        self._fused = fused_grow_step() if fusable else None
        if self._fused is not None:
            ws = DraftWorkspace.of(cache, capacity, max_slots, topk, H, forwards)
            self.nodes, self.row_hidden, self._ws = ws.nodes, ws.row_hidden, ws
            self._mask = ws.mask(self.start)
            h = self.nodes._host
            # the kernel's buffer arguments, fixed for the whole draft
            self._buffers = (ws.mask_value, h.token_ids[0], h.parents[0], h.depth[0], h.draft_probs[0],
                             h.log_scores[0], h.valid[0], ws.hidden_np, ws.rows, self._mask,
                             ws.next, ws.in_hidden[0], ws.in_ids[0])
            self._target_ids = drafter.draft_vocab_target_ids().numpy()
            self._fused_grow(root_probs.numpy()[0], cache.last_hidden.numpy()[:1], np.zeros(1, dtype=np.int64),
                             is_root=True)
            self.frontier = ws.frontier
            self._positions_np = ws.positions(self.start)  # [steps - 1, topk]: row `step` holds S + step
        else:
            self.nodes = TreeBuffer(1, capacity, device)
            self.row_hidden = cache.last_hidden.new_empty(1, capacity // topk, H)  # as DraftWorkspace.row_hidden
            # CPU: the per-step copies go through a numpy view (~5 us a step instead of ~13)
            host = _host_view(self.row_hidden)
            self._hidden_np = None if host is None else host[0]
            self.masks = _TreeMasks(self.start, max_slots, capacity, topk, self.kv.dtype, device)
            ids, probs = _top_children(drafter, root_probs, topk)  # [1, 1, topk]
            probs = self._alive_only(probs)
            self.frontier = self.nodes.add_root(ids[:, 0], probs[:, 0])
            self._write_hidden(0, cache.last_hidden[0][None])
            # [steps - 1, topk]: row `step` holds position S + step (made once for the whole draft; on CPU by numpy)
            self._positions_np = None
            if device.type == "cpu":
                self._positions_np = np.repeat(np.arange(self.start, self.start + forwards)[:, None], topk, 1)
            else:
                self.positions = torch.arange(self.start, self.start + forwards, device=device)[:, None].expand(forwards, topk)
        self.stopped = False
        self.padded = padded  # expand the frontier with its -1 pads, never reading how many are real
        self.f: torch.Tensor | None = None  # the frontier's node idx [F] being expanded (-1 pads when padded)
        self.rows: torch.Tensor | None = None  # f with pads read as node 0 (what the forward's rows gather)
        self.width = 0  # F

    def _fused_grow(self, probs: np.ndarray, hidden: np.ndarray, frontier: np.ndarray, is_root: bool = False) -> None:
        """`grow_step` on this tree's buffers: probs [F, V_draft] and hidden [F, H] of the frontier's rows."""
        n, m = self.nodes._take(probs.shape[0] * self.topk)
        self._num_next = self._fused(probs, hidden, frontier, self._target_ids, self.topk, n,
                                     self.num_slots, self.start, is_root, *self._buffers)
        self.nodes.num_nodes = m

    def expands(self, ddd_threshold: float | None, should_expand: ExpandRule | None) -> bool:
        """Whether this request's frontier is expanded at this step (once it stops, it stays stopped)."""
        if self.stopped:
            return False
        if self.padded:  # no stop rule here: every step expands, and nothing is read back
            self.f = self.frontier[0]
            self.rows, self.width = self.f.clamp(min=0), self.f.numel()
            return True
        # the compiled step returned how many of its frontier entries are real (they come first)
        f = torch.from_numpy(self._ws.next[:self._num_next].copy()) if self._fused is not None else _valid(self.frontier[0])
        self.stopped = (f.numel() == 0
                        or (ddd_threshold is not None and bool(ddd_should_stop(self.nodes.tree().scores[:, f], ddd_threshold)[0]))
                        or (should_expand is not None and not should_expand(self.nodes.tree(), f)))
        self.f, self.rows, self.width = f, f, f.numel()
        return not self.stopped

    def constrained(self, logits: torch.Tensor, f: torch.Tensor | None) -> torch.Tensor:
        """Draft logits [1, F, V_draft] of frontier nodes f [F] (None: the root) under the request's
        rules after each node's path. Banned tokens get a finite logit: no NaN where a grammar allows
        none of the draft vocabulary (e.g. only eos, which it may lack); such nodes' children get
        probability 0."""
        paths = [[]] if f is None else _paths(self.nodes, f.tolist())
        out = self.constraint(paths, logits[0], self.drafter.draft_vocab_target_ids())  # [F, V_draft]
        self.alive = out.amax(-1) > _DEAD
        return out[None]

    def _alive_only(self, probs: torch.Tensor) -> torch.Tensor:
        """probs [1, F, topk] of children, 0 under nodes the constraint allows nothing after."""
        return probs if self.alive is None else probs * self.alive[None, :, None]

    def inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden of the forward that proposed each frontier node [1, F, H], their tokens [1, F])."""
        if self._fused is not None:  # gathered by the last grow
            ws = self._ws
            return torch.from_numpy(ws.in_hidden[:, :self.width]), torch.from_numpy(ws.in_ids[:, :self.width])
        return (self.row_hidden.index_select(1, torch.div(self.rows, self.topk, rounding_mode="floor")),
                self.nodes.token_ids.index_select(1, self.rows))

    def mask(self) -> torch.Tensor:
        """[1, 1, F, S + slots + F] the frontier's additive attention mask."""
        if self._fused is not None:  # written by the last grow
            F_ = self.width
            return torch.from_numpy(self._mask[None, None, :F_, :self.start + self.num_slots + F_])
        return self.masks.frontier(self.rows, self.num_slots)

    def position_ids(self, step: int) -> torch.Tensor:
        """[1, F] the frontier's positions at drafting step `step`: S + step for each row (on CPU a numpy slice
        handed over as a tensor: ~1 us against ~2-3 for a torch slice)."""
        if self._positions_np is not None:
            return torch.from_numpy(self._positions_np[step:step + 1, :self.width])
        return self.positions[step:step + 1, :self.width]

    def segment(self) -> PackedSegment:
        return PackedSegment(self.kv, self.start + self.num_slots, self.width, self.mask())

    def grow(self, probs: torch.Tensor, hidden: torch.Tensor) -> None:
        """Add the frontier's top-k children (probs [1, F, V_draft] and hidden [1, F, H] of this forward)."""
        n, F_ = self.nodes.num_nodes, self.width
        self.num_forwards += 1
        if self._fused is not None:
            self._fused_grow(probs.numpy()[0], hidden.numpy()[0], self.f.numpy())
            self.num_slots += F_
            return
        ids, probs = _top_children(self.drafter, probs, self.topk)  # [1, F, topk]
        self.frontier = self.nodes.grow(self.f[None], ids, self._alive_only(probs), self.topk, dense=not self.padded)
        self.masks.add_children(n, F_, self.topk, self.num_slots)
        self._write_hidden(n, hidden[0])
        self.num_slots += F_

    def _write_hidden(self, first: int, hidden: torch.Tensor) -> None:
        """Nodes first.. are the `topk` children of each of hidden's rows [F, H]: the rows' features go to
        rows first // topk.. of row_hidden."""
        r = first // self.topk
        if self._hidden_np is not None:
            self._hidden_np[r:r + hidden.shape[0]] = hidden.numpy()
        else:
            self.row_hidden[0, r:r + hidden.shape[0]].copy_(hidden)

    def result(self) -> Eagle3Draft:
        n = self.nodes.num_nodes
        return Eagle3Draft(tree=self.nodes.tree(), row_hidden=self.row_hidden[:, :n // self.topk], topk=self.topk,
                           num_forwards=self.num_forwards)


def _paths(nodes: TreeBuffer, f: list[int]) -> list[list[int]]:
    """The token paths (root's child first) ending at nodes f."""
    return _paths_of(nodes.token_ids[0].tolist(), nodes.parents[0].tolist(), f)


def _paths_of(tokens: list[int], parents: list[int], f: list[int]) -> list[list[int]]:
    """The token paths ending at nodes f of a tree given as token and parent lists."""
    paths = []
    for v in f:
        path = []
        while v >= 0:
            path.append(tokens[v])
            v = parents[v]
        paths.append(path[::-1])
    return paths


def _host_view(t: torch.Tensor) -> np.ndarray | None:
    """A numpy view of a CPU tensor's storage, for the small per-step writes numpy does ~10x cheaper than
    torch; None on an accelerator or for a dtype numpy lacks (bfloat16: those keep the torch ops)."""
    if t.device.type != "cpu" or t.dtype not in _NUMPY_DTYPES:
        return None
    return t.numpy()


def _filled(shape: tuple[int, int], value: float, dtype: torch.dtype, device) -> tuple[torch.Tensor, np.ndarray | None]:
    """A tensor of `value` and its numpy view (`_host_view`); made by numpy where it can (a drafting step
    allocates these anew, and numpy's allocation costs less than torch's)."""
    if torch.device(device).type == "cpu" and dtype in _NUMPY_DTYPES:
        a = np.full(shape, value, dtype=_NUMPY_DTYPES[dtype])
        return torch.from_numpy(a), a
    t = torch.full(shape, value, dtype=dtype, device=device)
    return t, _host_view(t)


_NUMPY_DTYPES = {torch.float32: np.float32, torch.float64: np.float64, torch.float16: np.float16}


def _valid(frontier: torch.Tensor) -> torch.Tensor:
    """The frontier's node idx without its -1 padding (on CPU through numpy: one op instead of three)."""
    if frontier.device.type == "cpu":
        f = frontier.numpy()
        return torch.from_numpy(f[f >= 0])
    return frontier[frontier >= 0]


class _TreeMasks:
    """Attention masks of tree drafting, kept up to date in place.

    `rows[v]` is node v's additive visibility of the tree key slots (0 = an ancestor's key, written
    when v is created from its parent's row); `mask` holds the committed prefix (always visible) and
    the tree part of the current frontier's rows.
    """

    def __init__(self, prefix_len: int, max_slots: int, capacity: int, topk: int, dtype: torch.dtype, device):
        hidden = torch.finfo(dtype).min
        self.prefix_len = prefix_len
        # CPU: the row copies go through numpy views of the same storage (~1 us per op instead of ~10)
        self.rows, self._rows_np = _filled((capacity, max(max_slots, 1)), hidden, dtype, device)
        self.mask, self._mask_np = _filled((topk, prefix_len + max_slots), 0.0, dtype, device)
        self.hidden = hidden  # the value of a slot a row does not see

    def frontier(self, f: torch.Tensor, num_slots: int) -> torch.Tensor:
        """[1, 1, F, S + num_slots + F] for frontier nodes f [F], whose own keys go to the next F slots:
        each sees the prefix, its ancestors' slots and its own slot."""
        F_, S = f.numel(), self.prefix_len
        if self._mask_np is not None:
            m, own = self._mask_np, np.arange(F_)
            m[:F_, S:S + num_slots + F_] = self._rows_np[f.numpy(), :num_slots + F_]  # new slots still hidden
            m[own, S + num_slots + own] = 0
            return self.mask[None, None, :F_, :S + num_slots + F_]
        mask = self.mask[:F_, :S + num_slots + F_]
        mask[:, S:].copy_(self.rows[f, :num_slots + F_])  # the new slots are still hidden in these rows
        mask[:, S + num_slots:].diagonal().zero_()
        return mask[None, None]

    def add_children(self, first: int, num_parents: int, topk: int, num_slots: int) -> None:
        """Children first.. of the last frontier (topk per parent, in order) see what their parent saw."""
        width = num_slots + num_parents
        if self._mask_np is not None:
            parents = self._mask_np[:num_parents, self.prefix_len:self.prefix_len + width]
            self._rows_np[first:first + num_parents * topk, :width] = np.repeat(parents, topk, axis=0)
            return
        parents = self.mask[:num_parents, self.prefix_len:self.prefix_len + width]
        self.rows[first:first + num_parents * topk, :width].view(num_parents, topk, width).copy_(parents[:, None])


def _top_children(drafter: "Eagle3Drafter", probs: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k draft-vocab tokens of probs [1, F, V_draft] -> (target ids, probs), each [1, F, topk]."""
    top_p, top_d = probs.topk(topk, dim=-1)
    return drafter.to_target_ids(top_d), top_p
