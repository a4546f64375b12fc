"""Lossless verification of a selected draft tree ("multi-draft" rejection sampling
with deterministic drafts, as in SpecInfer / EAGLE tree decoding).

Algorithm (DESIGN.md, "Verification"), per request, walking from the root:
  r := p(node)  (target distribution after temperature / top-k / top-p)
  for each child c of node, in layout (selection) order:
      accept c with probability r(c) / sum(r)        # u * sum(r) <= r(c)
      on acceptance: move to c and start again with r := p(c)
      on rejection:  r(c) := 0                        # the residual, renormalised implicitly
  if no child is accepted (or the node is a leaf): emit a sample of r / sum(r).

Glossary: *accepted* tokens are draft nodes on the walked path; the *bonus*
(or *correction*) token is the final sample. Greedy decoding uses p = one-hot on
the argmax, which turns the rule into "accept the child equal to the argmax".

Assumptions: draft tokens are deterministic given the context (top-k drafts, not
samples), siblings carry distinct tokens, and the tree was chosen without looking
at the verifier's random numbers. Under these the emitted tokens follow the target
distribution exactly (lossless). Randomness: one uniform per layout position
(used when that node is tested) and one for the final sample, drawn per request
from its own torch.Generator, so the vectorised and the reference implementation
consume identical numbers. A batch of greedy requests needs none and draws none.

Seeded requests (`seeds=`, core/seeded.py) use the position-keyed form of the same rule:
  x := inverse-CDF sample of p(node) with U(seed, output position of node's token)
  if a child of node carries x: accept it and continue there; else emit x.
x follows p(node), so the emitted tokens follow the target (lossless), and the token at
each output position is a function of the seed and the prefix alone: every tree, policy,
batch and guard decision gives the text plain decoding (`ar`) gives with that seed. A
child is accepted with probability p(child): the most any lossless rule can accept with
deterministic drafts, and what the sequential rule above accepts too (it is the same
coupling drawn child by child, so its acceptance and law are equal; only its numbers
depend on the tree). Unseeded requests keep the sequential rule: it draws from the
request's stream, which this module's tests and benchmarks pin, and gains nothing here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from .accept_host import compiled_greedy_walk
from .layout import TreeLayout
from .sampling import CORRUPT_LOGITS, SamplingConfig, all_finite, sample_from_probs, target_probs
from .seeded import PositionKeys


@dataclass(frozen=True)
class VerifyResult:
    accepted_pos: torch.Tensor  # [B, D] int64 layout positions of accepted nodes (root excluded), -1 pad
    num_accepted: torch.Tensor  # [B] int64
    emitted_ids: torch.Tensor  # [B, D+1] int64 accepted tokens then the bonus token, -1 pad
    num_emitted: torch.Tensor  # [B] int64 = num_accepted + 1

    def row(self, b: int) -> "VerifyResult":
        """Request b's result alone, as verifying it by itself gives it (views, batch of one)."""
        return VerifyResult(self.accepted_pos[b:b + 1], self.num_accepted[b:b + 1], self.emitted_ids[b:b + 1],
                            self.num_emitted[b:b + 1])

    def keep_positions(self) -> torch.Tensor:
        """[B, D+1] layout positions whose KV entries survive: root then accepted nodes (-1 pad)."""
        root = self.accepted_pos.new_zeros(self.accepted_pos.shape[0], 1)  # also when no node was verified (D = 0)
        return torch.cat([root, self.accepted_pos], 1)


def draw_uniforms(
    batch_size: int, num_positions: int, generators: list[torch.Generator | None] | None
) -> torch.Tensor:
    """[B, T+1] float64 uniforms: one per layout position, the last for the final sample."""
    rows = []
    for b in range(batch_size):
        g = generators[b] if generators else None
        rows.append(torch.rand(num_positions + 1, generator=g, dtype=torch.float64))
    if len(rows) == 1:
        return rows[0][None]
    return torch.stack(rows) if rows else torch.zeros(0, num_positions + 1, dtype=torch.float64)


def verify_tree(
    layout: TreeLayout,
    target_logits: torch.Tensor,
    configs: list[SamplingConfig],
    generators: list[torch.Generator | None] | None = None,
    uniforms: torch.Tensor | None = None,
    seeds: PositionKeys | None = None,
) -> VerifyResult:
    """Verify every request's tree; target_logits: [B, 1+K, V] at the layout positions. With `seeds`
    every request is seeded (the position-keyed rule, whose numbers come from its key and output
    position); else each draws from its generator (or uses `uniforms`, [B, 1+K+1])."""
    B, T = layout.token_ids.shape
    if target_logits.shape[:2] != (B, T):
        raise ValueError(f"target_logits shape {tuple(target_logits.shape)} does not match layout [B={B}, T={T}, V]")
    if len(configs) != B:
        raise ValueError(f"need one SamplingConfig per request: got {len(configs)} for batch {B}")
    if seeds is not None and len(seeds.keys) != B:
        raise ValueError(f"need one sampling key per request: got {len(seeds.keys)} for batch {B}")
    if all(c.greedy for c in configs):  # no random numbers are needed (nor drawn)
        if T == 1:  # no draft nodes: a plain decoding step
            return _plain_greedy(target_logits)
        if target_logits.device.type == "cpu":
            return _greedy_tree_host(layout, target_logits)
        return _greedy_tree(layout, target_logits)
    if seeds is not None:
        return _seeded_tree(layout, target_logits, configs, seeds)
    if uniforms is None:
        uniforms = draw_uniforms(B, T, generators)
    uniforms = uniforms.to(device=target_logits.device, dtype=torch.float32)
    if T == 1:
        return _plain_step(layout, target_logits, configs, uniforms)
    if target_logits.device.type == "cpu" and B <= HOST_WALK_MAX_BATCH:
        return _sampled_tree_host(layout, target_logits, configs, uniforms)
    # (greedy requests here share a batch with sampled ones: p is one-hot for them)
    return _walk_tensors(layout, target_logits.device, lambda cur, kids, depth: _sampling_step(
        layout, _probs_at(target_logits, cur, configs), kids, uniforms))


def _walk_tensors(layout: TreeLayout, device: torch.device, step: Callable) -> VerifyResult:
    """Both sampling rules' walk on tensors, every request at once, one depth per round:
    `step(cur [B], kids [B, C], depth)` returns each request's accepted child among `kids`
    (its current node's children, -1 pad; -1: none) and the token it emits when none is."""
    B = layout.batch_size
    children = _children(layout)  # [B, T, C]
    D = layout.max_depth
    rows = torch.arange(B, device=device)

    cur = torch.zeros(B, dtype=torch.int64, device=device)
    num_accepted = torch.zeros_like(cur)
    accepted_pos = torch.full((B, D), -1, dtype=torch.int64, device=cur.device)
    bonus = torch.zeros_like(cur)
    done = torch.zeros(B, dtype=torch.bool, device=cur.device)
    for depth in range(D + 1):
        kids = children[rows, cur]  # [B, C]
        chosen, sample = step(cur, kids, depth)
        stop = ~done & (chosen < 0)
        bonus = torch.where(stop, sample, bonus)
        moved = ~done & (chosen >= 0)
        if depth < D:
            accepted_pos[:, depth] = torch.where(moved, chosen, -1)
        num_accepted += moved.long()
        cur = torch.where(moved, chosen, cur)
        done |= stop
        if bool(done.all()):
            break
    return _result(layout, accepted_pos, num_accepted, bonus)


# Up to this many requests, CPU verification walks each tree on the host (below): the vectorised walk's
# ~10 small tensor ops per tested child cost ~0.9 ms on a 33-node tree, the host walk a tenth of that.
HOST_WALK_MAX_BATCH = 8


def _sampled_tree_host(layout: TreeLayout, target_logits: torch.Tensor, configs: list[SamplingConfig],
                       uniforms: torch.Tensor) -> VerifyResult:
    """The sampling walk for CPU tensors, request by request, on host lists: the distribution of a
    visited node only, its children tested in layout order with float32 scalars (the reference's
    arithmetic, op for op, so both accept the same nodes and draw the same bonus token)."""
    B, T = layout.token_ids.shape
    parents, tokens, valid = layout.parent_pos.tolist(), layout.token_ids.tolist(), layout.valid.tolist()
    u = uniforms.numpy()  # [B, T + 1] float32
    paths, bonuses = [], []
    for b in range(B):
        children: list[list[int]] = [[] for _ in range(T)]
        for j in range(1, T):
            if valid[b][j] and parents[b][j] >= 0:
                children[parents[b][j]].append(j)
        cur, path = 0, []
        while True:
            r = target_probs(target_logits[b, cur][None], configs[b])[0]  # [V] float32, modified in place
            probs = r.numpy()
            total, chosen = r.sum().numpy(), -1
            for child in children[cur]:
                tok = tokens[b][child]
                r_tok = probs[tok]
                if r_tok > 0 and u[b, child] * total <= r_tok:
                    chosen = child
                    break
                total = total - r_tok
                probs[tok] = 0.0
            if chosen < 0:
                bonus = int(sample_from_probs(r[None], uniforms[b, -1:])[0])
                break
            path.append(chosen)
            cur = chosen
        paths.append(path)
        bonuses.append(bonus)
    return _host_result(paths, bonuses, tokens, layout.max_depth)


def _host_result(paths: list[list[int]], bonuses: list[int], tokens: list[list[int]], D: int) -> VerifyResult:
    """The VerifyResult of host walks: per request its accepted layout positions and bonus token."""
    B = len(paths)
    # numpy arrays handed to torch: a few calls fewer than tensors made from nested lists (issue 25)
    accepted, emitted = np.full((B, D), -1, dtype=np.int64), np.full((B, D + 1), -1, dtype=np.int64)
    counts = np.empty((2, B), dtype=np.int64)  # accepted and emitted per request
    for b, (path, bonus, row) in enumerate(zip(paths, bonuses, tokens)):
        n = len(path)
        accepted[b, :n] = path
        emitted[b, :n + 1] = [row[j] for j in path] + [bonus]
        counts[:, b] = n, n + 1
    return _arrays_result(accepted, emitted, counts)


def _greedy_tree(layout: TreeLayout, target_logits: torch.Tensor) -> VerifyResult:
    """Greedy acceptance without a walk: one argmax over every position, then the deepest node
    whose whole path matches. A node matches when its token is the argmax at its parent and no
    earlier sibling matched first (the walk's "first child in layout order"); matched nodes whose
    ancestors all match form one chain, which is exactly the path the walk accepts."""
    B, T = layout.token_ids.shape
    rows = torch.arange(B, device=target_logits.device)
    best = target_logits.argmax(-1)  # [B, T]
    parent = layout.parent_pos.clamp(min=0)
    match = layout.valid & (layout.parent_pos >= 0) & (layout.token_ids == best.gather(1, parent))
    pos = torch.arange(T, device=match.device).expand(B, T)
    first = torch.full((B, T), T, dtype=torch.int64, device=match.device)  # first matching child per parent
    first.scatter_reduce_(1, parent, torch.where(match, pos, T), reduce="amin")
    match &= first.gather(1, parent) == pos
    match[:, 0] = True  # the root
    paths = layout.paths  # [B, T, D+1]
    on_path = match.gather(1, paths.clamp(min=0).reshape(B, -1)).view_as(paths) | (paths < 0)
    depth = torch.where(on_path.all(-1) & layout.valid, layout.depth, -1)
    last = depth.argmax(1)  # [B] the last accepted node (0 = root: nothing accepted)
    visited = paths[rows, last]  # [B, D+1] root .. last, -1 pad
    seen = target_logits.gather(1, visited.clamp(min=0)[:, :, None].expand(-1, -1, target_logits.shape[-1]))
    if not torch.isfinite(seen[visited >= 0]).all():
        raise ValueError(CORRUPT_LOGITS)
    return _result(layout, visited[:, 1:], depth[rows, last], best[rows, last])


def _greedy_tree_host(layout: TreeLayout, target_logits: torch.Tensor) -> VerifyResult:
    """_greedy_tree for CPU tensors: the walk itself on host lists, argmax at visited nodes only.

    Layout order puts every child after its parent, so one forward scan finds, for the
    current node, its first child (in layout order) carrying the argmax token, then
    continues from that child: the walk of the rule, in O(T) Python steps instead of
    ~25 small tensor ops. The visited rows' argmax and finiteness check run in numpy
    (~2 us a call against ~10 for torch's), which, like torch, returns the first maximum.
    """
    logits = target_logits.numpy() if target_logits.dtype in (torch.float32, torch.float64) else target_logits.float().numpy()
    walk = compiled_greedy_walk()
    if walk is not None:  # the walk, its argmaxes and checks in one compiled call per request (accept_host.py)
        return _greedy_tree_compiled(walk, layout, logits)
    # argmax at visited nodes only (a few of the T rows)
    result, paths = _chain_host(layout, lambda b, pos, depth: int(logits[b, pos].argmax()))
    for b, path in enumerate(paths):
        if not np.isfinite(logits[b, [0] + path]).all():  # (numpy rows: see all_finite)
            raise ValueError(CORRUPT_LOGITS)
    return result


def _arrays_result(accepted: np.ndarray, emitted: np.ndarray, counts: np.ndarray) -> VerifyResult:
    """A VerifyResult of host arrays: accepted [B, D], emitted [B, D+1] and counts [2, B] (accepted, emitted)."""
    return VerifyResult(torch.from_numpy(accepted), torch.from_numpy(counts[0]), torch.from_numpy(emitted),
                        torch.from_numpy(counts[1]))


def _greedy_tree_compiled(walk, layout: TreeLayout, logits: np.ndarray) -> VerifyResult:
    """_greedy_tree_host through `accept_host.greedy_walk`: logits [B, T, V] as numpy."""
    B, D = layout.batch_size, layout.max_depth
    accepted, emitted = np.empty((B, D), dtype=np.int64), np.empty((B, D + 1), dtype=np.int64)
    counts = np.empty((2, B), dtype=np.int64)  # accepted and emitted per request
    parents, tokens, valid = layout.parent_pos.numpy(), layout.token_ids.numpy(), layout.valid.numpy()
    for b in range(B):
        n = walk(logits[b], parents[b], tokens[b], valid[b], accepted[b], emitted[b])
        if n < 0:
            raise ValueError(CORRUPT_LOGITS)
        counts[:, b] = n, n + 1
    return _arrays_result(accepted, emitted, counts)


def _chain_host(layout: TreeLayout, pick: Callable[[int, int, int], int]) -> tuple[VerifyResult, list[list[int]]]:
    """The walk of the greedy and the seeded rule on host lists: from the root, move to the first
    child (in layout order) carrying `pick(b, pos, depth)`, the token the rule emits at position pos
    (at that depth) of request b; the last pick is the bonus. One forward scan finds it: layout order
    puts every child after its parent. Returns the result and each request's accepted positions."""
    B, T = layout.token_ids.shape
    parent, tokens, valid = layout.parent_pos.tolist(), layout.token_ids.tolist(), layout.valid.tolist()
    paths, bonuses = [], []
    for b in range(B):
        cur, path = 0, []
        best = pick(b, 0, 0)
        for j in range(1, T):
            if valid[b][j] and parent[b][j] == cur and tokens[b][j] == best:
                path.append(j)
                cur = j
                best = pick(b, j, len(path))
        paths.append(path)
        bonuses.append(best)
    return _host_result(paths, bonuses, tokens, layout.max_depth), paths


def _plain_greedy(target_logits: torch.Tensor) -> VerifyResult:
    """Emit argmax p(root) of each request: a greedy plain step. On CPU through numpy (two ~2 us
    calls instead of ~30 us of torch reductions: plain decoding runs this every token); numpy's
    argmax, like torch's, returns the first maximum."""
    logits = target_logits[:, 0]  # [B, V]
    if not all_finite(logits):
        raise ValueError(CORRUPT_LOGITS)
    if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.float64):
        return _root_only_result(torch.from_numpy(logits.numpy().argmax(-1)))
    return _root_only_result(logits.argmax(-1))


def _plain_step(layout: TreeLayout, target_logits: torch.Tensor, configs: list[SamplingConfig],
                uniforms: torch.Tensor) -> VerifyResult:
    """Emit one token from p(root): the same rule with no children to test."""
    logits = target_logits[:, 0]  # [B, V] (a view: every request is at its root)
    if all(c == configs[0] for c in configs):
        probs = target_probs(logits, configs[0])
    else:
        probs = torch.cat([target_probs(logits[b:b + 1], cfg) for b, cfg in enumerate(configs)])
    return _root_only_result(sample_from_probs(probs, uniforms[:, -1]))


def _root_only_result(token: torch.Tensor) -> VerifyResult:
    """The result of a step that accepted nothing and emitted `token` [B]."""
    B, device = token.shape[0], token.device
    return VerifyResult(torch.empty(B, 0, dtype=torch.int64, device=device), torch.zeros(B, dtype=torch.int64, device=device),
                        token.long().view(B, 1), torch.ones(B, dtype=torch.int64, device=device))


def _sampling_step(
    layout: TreeLayout, r: torch.Tensor, kids: torch.Tensor, uniforms: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Test the current nodes' children in order against the residual r [B, V] (modified in place).

    Returns (accepted child [B] or -1, a sample of the final residual [B]).
    """
    rows = torch.arange(r.shape[0], device=r.device)
    total = r.sum(-1)
    chosen = torch.full_like(rows, -1)
    for c in range(kids.shape[1]):
        child = kids[:, c]
        active = (child >= 0) & (chosen < 0)
        tok = layout.token_ids[rows, child.clamp(min=0)]
        r_tok = r[rows, tok]
        u = uniforms[rows, child.clamp(min=0)]
        accept = active & (r_tok > 0) & (u * total <= r_tok)
        chosen = torch.where(accept, child, chosen)
        reject = active & ~accept
        r[rows, tok] = torch.where(reject, 0.0, r_tok)
        total = torch.where(reject, total - r_tok, total)
    return chosen, sample_from_probs(r, uniforms[:, -1])


def _seeded_tree(layout: TreeLayout, target_logits: torch.Tensor, configs: list[SamplingConfig],
                 seeds: PositionKeys) -> VerifyResult:
    """The position-keyed rule (module docstring): the greedy rule's walk with the argmax at a visited
    node replaced by its target sample under U(key, start + depth). Only visited nodes are processed."""
    B, T = layout.token_ids.shape
    u = seeds.uniforms(layout.max_depth).to(target_logits.device)  # [B, D+1]
    if T == 1:  # a plain step
        zeros = torch.zeros(B, dtype=torch.int64, device=target_logits.device)
        return _root_only_result(sample_from_probs(_probs_at(target_logits, zeros, configs), u[:, 0]))
    if target_logits.device.type == "cpu" and B <= HOST_WALK_MAX_BATCH:
        return _seeded_tree_host(layout, target_logits, configs, u)
    return _walk_tensors(layout, target_logits.device, lambda cur, kids, depth: _seeded_step(
        layout, _probs_at(target_logits, cur, configs), kids, u[:, depth]))


def _seeded_tree_host(layout: TreeLayout, target_logits: torch.Tensor, configs: list[SamplingConfig],
                      u: torch.Tensor) -> VerifyResult:
    """The position-keyed rule for small CPU batches, on host lists (the sample at each visited node
    is the tensor path's: the same target_probs row and sample_from_probs call)."""
    def pick(b: int, pos: int, depth: int) -> int:
        probs = target_probs(target_logits[b, pos][None], configs[b])  # [1, V]
        return int(sample_from_probs(probs, u[b, depth:depth + 1])[0])

    return _chain_host(layout, pick)[0]


def _seeded_step(layout: TreeLayout, probs: torch.Tensor, kids: torch.Tensor,
                 u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample each current node's token from probs [B, V] with its uniform u [B]; the accepted child
    is the first of kids [B, C] (-1 pad) carrying it, -1 if none does. Returns (child, sample) [B]."""
    sample = sample_from_probs(probs, u)  # [B]
    rows = torch.arange(kids.shape[0], device=kids.device)[:, None]
    hit = (kids >= 0) & (layout.token_ids[rows, kids.clamp(min=0)] == sample[:, None])  # [B, C]
    first = kids.gather(1, hit.long().argmax(1, keepdim=True))[:, 0]  # argmax: the first hit
    return torch.where(hit.any(1), first, -1), sample


def _probs_at(target_logits: torch.Tensor, cur: torch.Tensor, configs: list[SamplingConfig]) -> torch.Tensor:
    """[B, V] target distribution at each request's current node (only visited nodes are processed)."""
    logits = target_logits[torch.arange(len(cur), device=cur.device), cur]  # [B, V]
    if all(c == configs[0] for c in configs):
        return target_probs(logits, configs[0])
    return torch.cat([target_probs(logits[b : b + 1], cfg) for b, cfg in enumerate(configs)])


def _children(layout: TreeLayout) -> torch.Tensor:
    """[B, T, C] layout positions of each position's children in layout order, -1 pad."""
    B, T = layout.token_ids.shape
    is_child = (layout.parent_pos[:, None, :] == torch.arange(T, device=layout.parent_pos.device)[None, :, None]) & layout.valid[:, None, :]
    rank = is_child.long().cumsum(-1) - 1  # [B, parent T, child T]
    C = max(int(is_child.sum(-1).max().item()) if T else 0, 1)
    out = torch.full((B, T, C + 1), -1, dtype=torch.int64, device=layout.parent_pos.device)
    child_idx = torch.arange(T, device=out.device).expand(B, T, T)
    out.scatter_(2, torch.where(is_child, rank, C), torch.where(is_child, child_idx, -1))
    return out[:, :, :C]


def _result(layout: TreeLayout, accepted_pos: torch.Tensor, num_accepted: torch.Tensor, bonus: torch.Tensor) -> VerifyResult:
    B = layout.batch_size
    D = accepted_pos.shape[1]
    tokens = layout.token_ids.gather(1, accepted_pos.clamp(min=0))
    emitted = torch.full((B, D + 1), -1, dtype=torch.int64, device=accepted_pos.device)
    emitted[:, :D] = torch.where(accepted_pos >= 0, tokens, -1)
    emitted.scatter_(1, num_accepted[:, None], bonus[:, None])
    return VerifyResult(accepted_pos, num_accepted, emitted, num_accepted + 1)


def verify_tree_reference(
    layout: TreeLayout,
    target_logits: torch.Tensor,
    configs: list[SamplingConfig],
    uniforms: torch.Tensor,
) -> VerifyResult:
    """Plain-Python reference of verify_tree (same rule, same uniforms); for tests."""
    B, T = layout.token_ids.shape
    D = layout.max_depth
    u = uniforms.float()
    accepted_pos = torch.full((B, D), -1, dtype=torch.int64)
    num_accepted = torch.zeros(B, dtype=torch.int64)
    bonus = torch.zeros(B, dtype=torch.int64)
    for b in range(B):
        parent = layout.parent_pos[b].tolist()
        valid = layout.valid[b].tolist()
        node, n = 0, 0
        while True:
            r = target_probs(target_logits[b, node][None].cpu(), configs[b])[0]
            total = r.sum()
            chosen = -1
            for child in (j for j in range(T) if valid[j] and parent[j] == node):
                tok = int(layout.token_ids[b, child])
                if r[tok] > 0 and u[b, child] * total <= r[tok]:
                    chosen = child
                    break
                total = total - r[tok]
                r[tok] = 0.0
            if chosen < 0:
                bonus[b] = sample_from_probs(r[None], u[b, -1:])[0]
                break
            accepted_pos[b, n] = chosen
            n += 1
            node = chosen
        num_accepted[b] = n
    return _result(layout, accepted_pos, num_accepted, bonus)
