"""Node values: the estimated probability that the target accepts a draft node given its path.

Every cost-aware policy (evict, ecospec, joint, coverage) ranks and stops on *values*
instead of raw draft path scores. Raw path scores under-estimate acceptance, more
with depth: the KL-distilled drafter tracks the target's probability, while greedy
acceptance needs an argmax match (best child q ~ 0.2 is accepted ~70% of the time).

    value(v) = prod over the root->v path of c(u),   c(u) = P(target accepts u | u's parent accepted)

A `ValueModel` produces the conditional c(v) of every node from a per-node *local
score* x(v) (the draft probability q, or a learned head's output) through a monotone
(isotonic) map per node group (depth x sibling rank x "repeats the context", see
`Calibrator`), then composes it along the path. Because every c lies in
(0, 1], a child's value never exceeds its parent's: score-ordered prefixes stay
parent-closed, exactly as with raw scores (ties break by depth, so a parent comes first).

The map starts from a prior (fitted offline on recorded steps and shipped with the
model) and is updated online, per request, from what every step observes anyway: each
verified node whose parent was accepted is one trial, accepted or not (no extra
forward). That holds at T=0 (argmax matches) and T>0 (sampled acceptances).

Values only change *which* nodes are verified, never how: verification stays lossless.
Per-request state keeps a seeded generation reproducible (no cross-request drift).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from .device import to_device
from .followers_host import copy_flags_of
from .node_features import NGRAM_ORDERS, ContextFollowers, copies_recent, sibling_rank
from .sampling import SamplingConfig
from .tree import DraftTree
from .values_host import MIN_COND, compiled_values

VALUE_KINDS = ("raw", "calibrated", "head")
CALIBRATOR_FORMAT = "moespec-value-calibrator"
# Local-score bin edges: drafter probabilities crowd near 0, so the low bins are narrow.
DEFAULT_EDGES = (0.0, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8,
                 0.9, 1.0)


class RequestValues(Protocol):
    """One request's value state: values for each step's tree, updated from each step's outcome."""

    def values(self, tree: DraftTree, draft=None, context: list[int] | None = None) -> torch.Tensor:
        """[B, N] float32 node values in [0, 1] (0 for padding); child <= parent. `draft` carries the
        drafter's per-node features (may be None), `context` the committed token ids (root last)."""

    def observe(self, tree: DraftTree, node_idx: torch.Tensor, accepted_nodes: torch.Tensor) -> None:
        """node_idx [B, K] the verified nodes (-1 pad); accepted_nodes [B, D] tree idx of accepted ones (-1 pad)."""


class ValueModel(Protocol):
    """What the engine holds: a factory of per-request value states."""

    name: str

    def for_request(self, sampling: SamplingConfig) -> RequestValues: ...


# ---------------------------------------------------------------------------------------------- path algebra
def path_values(tree: DraftTree, cond: torch.Tensor) -> torch.Tensor:
    """[B, N] products of cond [B, N] (clamped to [1e-6, 1]) along each root->v path; 0 for padding."""
    B, N = tree.token_ids.shape
    if N == 0:
        return torch.zeros(B, 0, dtype=torch.float32, device=tree.token_ids.device)
    logc = np.log(np.clip(cond.detach().cpu().double().numpy(), MIN_COND, 1.0))
    parents, depth, valid = (t.cpu().numpy() for t in (tree.parents, tree.depth, tree.valid))
    logv = np.where(valid, logc, -np.inf)
    for d in range(2, int(depth.max()) + 1):  # depth-1 nodes hang from the root
        b, i = np.nonzero((depth == d) & valid)
        logv[b, i] += logv[b, parents[b, i]]
    return torch.from_numpy(np.exp(logv).astype(np.float32)).to(tree.token_ids.device)


def with_values(tree: DraftTree, values: torch.Tensor) -> DraftTree:
    """The same tree with its path scores replaced by values [B, N] (what the policies rank on)."""
    if values.shape != tree.token_ids.shape:
        raise ValueError(f"values {tuple(values.shape)} do not match the tree {tuple(tree.token_ids.shape)}")
    log_v = values.float().clamp(min=1e-30).log_().masked_fill_(~tree.valid, -math.inf)  # the padding: -inf
    return DraftTree(tree.token_ids, tree.parents, tree.depth, tree.draft_probs, log_v, tree.valid)


def observed_trials(tree: DraftTree, node_idx: torch.Tensor, accepted_nodes: torch.Tensor
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The trials a verify step observed: verified nodes whose parent is the root or was accepted.

    Returns (batch row, node idx, depth, accepted 0/1) as flat numpy arrays.
    """
    rows, nodes, depths, hits = [], [], [], []
    parents, depth = tree.parents.cpu().numpy(), tree.depth.cpu().numpy()
    sel, acc = node_idx.cpu().tolist(), accepted_nodes.cpu().tolist()  # a few dozen ints: Python lists
    for b in range(len(sel)):
        accepted = set(a for a in acc[b] if a >= 0)
        verified = [v for v in sel[b] if v >= 0]
        for v, p, d in zip(verified, parents[b, verified].tolist(), depth[b, verified].tolist()):
            if p == -1 or p in accepted:
                rows.append(b), nodes.append(v), depths.append(d), hits.append(v in accepted)
    as_np = lambda x, t: np.asarray(x, dtype=t)  # noqa: E731
    return as_np(rows, np.int64), as_np(nodes, np.int64), as_np(depths, np.int64), as_np(hits, np.float64)


def accepted_nodes(node_idx: torch.Tensor, accepted_pos: torch.Tensor) -> torch.Tensor:
    """[B, D] tree idx of accepted nodes from a verify result's layout positions (1-based, -1 pad)."""
    if node_idx.device.type == "cpu" and accepted_pos.device.type == "cpu":  # numpy: ~3x fewer microseconds
        pos, idx = accepted_pos.numpy(), node_idx.numpy()
        if not idx.shape[1]:
            return torch.from_numpy(np.where(pos > 0, pos, -1))
        if len(pos) == 1:  # one request: a few positions, read on host lists (fewer calls still)
            row = idx[0].tolist()
            return torch.tensor([[row[p - 1] if p > 0 else -1 for p in pos[0].tolist()]], dtype=torch.int64)
        picked = np.take_along_axis(idx, np.maximum(pos, 1) - 1, axis=1)
        return torch.from_numpy(np.where(pos > 0, picked, -1))
    pos = accepted_pos.clamp(min=1) - 1
    return torch.where(accepted_pos > 0, node_idx.gather(1, pos) if node_idx.shape[1] else accepted_pos, -1)


# ---------------------------------------------------------------------------------------------- isotonic map
def isotonic_fit(y: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Weighted pool-adjacent-violators: the non-decreasing fit of y [M] with weights w [M] > 0."""
    level, weight, size = [], [], []
    for yi, wi in zip(y.tolist(), w.tolist()):
        level.append(yi), weight.append(wi), size.append(1)
        while len(level) > 1 and level[-2] > level[-1]:
            wt = weight[-2] + weight[-1]
            lv = (level[-2] * weight[-2] + level[-1] * weight[-1]) / wt
            sz = size[-2] + size[-1]
            del level[-1], weight[-1], size[-1]
            level[-1], weight[-1], size[-1] = lv, wt, sz
    return np.repeat(np.asarray(level), size)


@dataclass(frozen=True)
class CalibrationTable:
    """Binned trials of one temperature per node group: the sufficient statistics of the isotonic maps."""

    temperature: float
    trials: tuple[tuple[float, ...], ...]  # [G][M] trials per (group, local-score bin)
    accepted: tuple[tuple[float, ...], ...]  # [G][M] accepted trials

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        return np.asarray(self.trials, dtype=np.float64), np.asarray(self.accepted, dtype=np.float64)


@dataclass(frozen=True)
class Calibrator:
    """Monotone maps from a local score in [0, 1] to conditional acceptance, one per node group.

    A node's group is (depth, its rank among its siblings by q, whether its token is the most
    recent continuation of the last two tokens of its path in the context): acceptance differs
    far more across these than q says (the best child is accepted ~70% of the time at q ~ 0.2;
    a token that repeats what followed last time is accepted far more often on repetitive text).
    Depths beyond `num_depths` share the last depth's maps; ranks beyond `num_ranks` the last rank's.
    `prior_weight` caps the prior's trials per bin, so a request's own observations can move the
    maps within a few steps (predictability changes from prompt to prompt).
    """

    edges: tuple[float, ...] = DEFAULT_EDGES
    tables: tuple[CalibrationTable, ...] = ()  # one per calibrated temperature; none = identity prior
    prior_weight: float = 50.0
    source: str = "identity"  # where the prior came from (command / data), for the record
    num_depths: int = 4
    num_ranks: int = 3
    copy: bool = True  # split groups by the copy feature (needs the context)

    def __post_init__(self) -> None:
        e = np.asarray(self.edges)
        if e.ndim != 1 or len(e) < 2 or e[0] != 0.0 or e[-1] != 1.0 or (np.diff(e) <= 0).any():
            raise ValueError("calibrator bin edges must increase strictly from 0 to 1")
        if self.num_depths < 1 or self.num_ranks < 1:
            raise ValueError("calibrator num_depths and num_ranks must be >= 1")
        for t in self.tables:
            tr, ac = t.arrays()
            if tr.shape != (self.num_groups, len(e) - 1) or ac.shape != tr.shape:
                raise ValueError(f"calibrator table for T={t.temperature} must be [{self.num_groups} groups, "
                                 f"{len(e) - 1} bins], got {tr.shape}")
            if (ac < 0).any() or (ac > tr + 1e-9).any():
                raise ValueError("calibrator table has accepted counts outside [0, trials]")
        if not self.prior_weight > 0:
            raise ValueError(f"calibrator prior_weight must be > 0, got {self.prior_weight}")

    @property
    def num_bins(self) -> int:
        return len(self.edges) - 1

    @property
    def num_groups(self) -> int:
        return self.num_depths * self.num_ranks * (2 if self.copy else 1)

    def group_ids(self, depth: np.ndarray, rank: np.ndarray, copies: np.ndarray) -> np.ndarray:
        """Group index of nodes with these depths (>= 1), sibling ranks and copy flags."""
        g = (np.clip(depth, 1, self.num_depths) - 1) * self.num_ranks + np.clip(rank, 0, self.num_ranks - 1)
        return g * 2 + np.asarray(copies, dtype=np.int64) if self.copy else g

    def node_groups(self, tree: DraftTree, context: list[int] | None, index=None) -> np.ndarray:
        """[B, N] group of every node (0 for padding); `index`: a per-request ContextFollowers (batch of one)."""
        B, N = tree.token_ids.shape
        out = np.zeros((B, N), dtype=np.int64)
        for b in range(B):
            row = tree if B == 1 else DraftTree(*(t[b:b + 1] for t in (tree.token_ids, tree.parents, tree.depth,
                                                                         tree.draft_probs, tree.log_scores, tree.valid)))
            rank = sibling_rank(row) if self.num_ranks > 1 else np.zeros(N, dtype=np.int64)
            copies = copies_recent(row, context, index=index if B == 1 else None) if (self.copy and context) \
                else np.zeros(N, dtype=np.int64)
            out[b] = self.group_ids(row.depth[0].cpu().numpy(), rank, copies)
        return out

    def prior_for(self, temperature: float) -> tuple[np.ndarray, np.ndarray]:
        """(trials, accepted) [G, M] of the table nearest in temperature, capped at prior_weight per bin,
        plus an identity pseudo-trial per bin (rate = bin centre) so that empty bins stay defined."""
        centers = self.centers()
        if not self.tables:
            return np.ones((self.num_groups, self.num_bins)), np.repeat(centers[None], self.num_groups, 0)
        table = min(self.tables, key=lambda t: abs(t.temperature - temperature))
        trials, acc = table.arrays()
        scale = np.minimum(1.0, self.prior_weight / np.maximum(trials, 1e-12))
        return trials * scale + 1.0, acc * scale + centers[None]

    def centers(self) -> np.ndarray:
        e = np.asarray(self.edges)
        return (e[:-1] + e[1:]) / 2

    def start(self, temperature: float) -> "OnlineCalibration":
        trials, acc = self.prior_for(temperature)
        return OnlineCalibration(np.asarray(self.edges), trials, acc)

    # ------------------------------------------------------------------ persistence
    def to_json(self) -> str:
        return json.dumps({
            "format": CALIBRATOR_FORMAT, "version": 2, "edges": list(self.edges), "prior_weight": self.prior_weight,
            "source": self.source, "num_depths": self.num_depths, "num_ranks": self.num_ranks, "copy": self.copy,
            "tables": [{"temperature": t.temperature, "trials": [list(r) for r in t.trials],
                        "accepted": [list(r) for r in t.accepted]} for t in self.tables],
        }, indent=1) + "\n"

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.to_json())
        return path

    @staticmethod
    def load(path: str | Path) -> "Calibrator":
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"value calibrator not found: {path}")
        try:
            raw = json.loads(path.read_text())
            if raw.get("format") != CALIBRATOR_FORMAT:
                raise ValueError(f"format is {raw.get('format')!r}, expected {CALIBRATOR_FORMAT!r}")
            tables = tuple(CalibrationTable(float(t["temperature"]), tuple(tuple(map(float, r)) for r in t["trials"]),
                                            tuple(tuple(map(float, r)) for r in t["accepted"])) for t in raw["tables"])
            return Calibrator(tuple(map(float, raw["edges"])), tables, float(raw["prior_weight"]), str(raw["source"]),
                              int(raw["num_depths"]), int(raw["num_ranks"]), bool(raw["copy"]))
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise ValueError(f"value calibrator {path} is malformed: {err}") from None

    @staticmethod
    def identity(weight: float) -> "Calibrator":
        """A prior that trusts the local score as it is (rate = bin centre) with `weight` trials per bin,
        one group: for a local score that is already a calibrated probability (the acceptance head)."""
        e = np.asarray(DEFAULT_EDGES)
        centers = (e[:-1] + e[1:]) / 2
        table = CalibrationTable(0.0, (tuple(float(weight) for _ in centers),),
                                 (tuple(float(weight * c) for c in centers),))
        return Calibrator(DEFAULT_EDGES, (table,), weight, f"identity, weight {weight:g}", 1, 1, False)

    def fit(self, samples: dict[float, tuple[np.ndarray, ...]], source: str = "") -> "Calibrator":
        """This grouping with a prior from observed trials: samples[temperature] = (group [n], local score [n],
        accepted [n] in [0, 1][, weight [n]: how much each trial counts, e.g. the probability that the target
        accepts the node's parent, so that a trial is what `c(v) = P(accept v | parent accepted)` means])."""
        tables = []
        for temperature, (group, score, hit, *weight) in sorted(samples.items()):
            trials, acc = _bin_counts(np.asarray(self.edges), group, score, hit, self.num_groups, *weight)
            tables.append(CalibrationTable(float(temperature), tuple(map(tuple, trials.tolist())),
                                           tuple(map(tuple, acc.tolist()))))
        return replace(self, tables=tuple(tables), source=source)


def _bin_counts(edges: np.ndarray, group: np.ndarray, score: np.ndarray, hit: np.ndarray, num_groups: int,
                weight: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    M = len(edges) - 1
    trials, acc = np.zeros((num_groups, M)), np.zeros((num_groups, M))
    if len(group):
        m = np.clip(np.searchsorted(edges, np.asarray(score, dtype=np.float64), side="right") - 1, 0, M - 1)
        w = np.ones(len(group)) if weight is None else np.asarray(weight, dtype=np.float64)
        np.add.at(trials, (np.asarray(group), m), w)
        np.add.at(acc, (np.asarray(group), m), w * np.asarray(hit, dtype=np.float64))
    return trials, acc


@dataclass
class OnlineCalibration:
    """A calibrator's running state for one request: prior + this request's trials, refit lazily."""

    edges: np.ndarray  # [M+1]
    trials: np.ndarray  # [G, M]
    accepted: np.ndarray  # [G, M]
    _maps: np.ndarray | None = field(default=None, repr=False)  # [G, M] fitted rates (None = not fitted yet)
    _stale: set = field(default_factory=set, repr=False)  # groups whose counts changed since the last fit
    centers: np.ndarray = field(init=False, repr=False)  # [M] the bins' centres, where the maps are read

    def __post_init__(self) -> None:
        self.centers = (self.edges[:-1] + self.edges[1:]) / 2

    def maps(self) -> np.ndarray:
        """[G, M] isotonic conditional-acceptance rate per (group, bin); refits only the groups that changed."""
        if self._maps is None:
            self._maps = np.zeros_like(self.trials)
            self._stale = set(range(self.trials.shape[0]))
        kernels = compiled_values()
        if kernels is not None:  # every changed group in one compiled call
            if self._stale:
                kernels[3](self.accepted, self.trials, np.fromiter(self._stale, np.int64, len(self._stale)), self._maps)
        else:
            for g in self._stale:
                rate = self.accepted[g] / np.maximum(self.trials[g], 1e-12)
                self._maps[g] = isotonic_fit(rate, self.trials[g])
        self._stale = set()
        return self._maps

    def conditional(self, group: np.ndarray, score: np.ndarray) -> np.ndarray:
        """Conditional acceptance of nodes of these groups with these local scores, interpolated linearly
        between bin centres (monotone in the score within every group)."""
        maps, centers = self.maps(), self.centers
        x = np.clip(score, centers[0], centers[-1])
        hi = np.clip(np.searchsorted(centers, x, side="right"), 1, len(centers) - 1)
        w = (x - centers[hi - 1]) / (centers[hi] - centers[hi - 1])
        out = maps[group, hi - 1] * (1 - w) + maps[group, hi] * w
        return np.clip(out, MIN_COND, 1.0)

    def update(self, group: np.ndarray, score: np.ndarray, hit: np.ndarray) -> None:
        if len(group) == 0:
            return
        # a step observes a few trials: added one by one in place (the arrays are this request's own)
        bins = np.clip(np.searchsorted(self.edges, np.asarray(score, dtype=np.float64), side="right") - 1, 0,
                       len(self.edges) - 2)
        groups = np.asarray(group).tolist()
        for g, m, h in zip(groups, bins.tolist(), np.asarray(hit, dtype=np.float64).tolist()):
            self.trials[g, m] += 1.0
            self.accepted[g, m] += h
        self._stale |= set(groups)

    def add_trials(self, kernel, parents: np.ndarray, selected: np.ndarray, accepted: np.ndarray, groups: np.ndarray,
                   local: np.ndarray) -> None:
        """`update` with one step's `observed_trials` in one compiled call (values_host.add_trials): one tree's
        parents [N], the verified nodes [K] and accepted ones [D] (-1 pads), each node's group and local score [N]."""
        touched = np.zeros(self.trials.shape[0], dtype=bool)
        kernel(parents, selected, accepted, groups, local, self.edges, self.trials, self.accepted, touched)
        self._stale |= set(np.flatnonzero(touched).tolist())


# ---------------------------------------------------------------------------------------------- value models
class RawValues:
    """Ablation: the raw draft path score as the value (what the policies used before)."""

    name = "raw"

    def for_request(self, sampling: SamplingConfig) -> "RawValues":
        return self

    def values(self, tree: DraftTree, draft=None, context: list[int] | None = None) -> torch.Tensor:
        return tree.scores

    def observe(self, tree: DraftTree, node_idx: torch.Tensor, accepted: torch.Tensor) -> None:
        return None


class LocalScore(Protocol):
    """Per-node local score in [0, 1] that a calibrator maps to conditional acceptance."""

    def __call__(self, tree: DraftTree, draft, context: list[int] | None,
                 followers: ContextFollowers | None = None) -> torch.Tensor: ...  # [B, N]; followers: the request's


def draft_prob(tree: DraftTree, draft=None, context: list[int] | None = None,
               followers: ContextFollowers | None = None) -> torch.Tensor:
    """The local draft probability q(v): the calibrated value model's local score."""
    return tree.draft_probs


@dataclass(frozen=True)
class CalibratedValues:
    """Values = per-group isotonic map of a local score, composed along the path, updated online.

    With `local=draft_prob` this is the calibrated draft probability; a learned acceptance
    head plugs in its own local score (and keeps the online correction).
    """

    calibrator: Calibrator = field(default_factory=Calibrator)
    local: LocalScore = draft_prob
    name: str = "calibrated"
    online: bool = True  # False: the prior only (ablation)

    def for_request(self, sampling: SamplingConfig) -> "_CalibratedRequest":
        return _CalibratedRequest(self, self.calibrator.start(sampling.temperature))


@dataclass
class _CalibratedRequest:
    model: CalibratedValues
    state: OnlineCalibration
    _last: tuple[torch.Tensor, np.ndarray] | None = None  # local scores [B, N] and groups [B, N] of the last tree
    _index: ContextFollowers = field(default_factory=ContextFollowers)  # the context's n-gram followers, incremental

    def values(self, tree: DraftTree, draft=None, context: list[int] | None = None) -> torch.Tensor:
        # host code from here on: a device tree is read back once, not once per feature
        host = tree.on_host()
        local = self.model.local(host, draft, context, self._index).detach().float().cpu()
        kernels = compiled_values() if host.batch_size == 1 else None
        if kernels is not None:
            out = self._compiled_values(host, local, context, kernels[0])
            if out is not None:
                return to_device(out, tree.token_ids.device)
        groups = self.model.calibrator.node_groups(host, context, self._index)
        self._last = (local, groups)
        cond = np.ones(tuple(host.token_ids.shape))
        valid = host.valid.numpy()
        if valid.any():
            cond[valid] = self.state.conditional(groups[valid], local.double().numpy()[valid])
        return to_device(path_values(host, torch.from_numpy(cond)), tree.token_ids.device)

    def _compiled_values(self, host: DraftTree, local: torch.Tensor, context: list[int] | None, kernel
                         ) -> torch.Tensor | None:
        """`values` of a batch of one in one compiled call (values_host.py); None when the tree's nodes
        are not in parent-first order (the numpy path then runs)."""
        cal = self.model.calibrator
        N = host.num_nodes
        copies = np.zeros(N, dtype=np.int64)
        if cal.copy and context:  # copies_recent's flags (n = 2), from the compiled n-gram tables (followers_host.py)
            flags = np.empty((N, 2 * len(NGRAM_ORDERS)), dtype=np.float32)
            if not copy_flags_of(host, context, self._index, flags, with_seen=False):
                return None
            copies = flags[:, 2 * NGRAM_ORDERS.index(2) + 1].astype(np.int64)  # n = 2, most recent
        groups, values = np.empty(N, dtype=np.int64), np.empty(N, dtype=np.float32)
        ok = kernel(host.parents[0].numpy(), host.depth[0].numpy(), host.draft_probs[0].numpy(),
                    local[0].numpy(), host.valid[0].numpy(), copies, self.state.maps(), self.state.centers,
                    cal.num_depths, cal.num_ranks, cal.copy, groups, values)
        if not ok:
            return None
        self._last = (local, groups[None])
        return torch.from_numpy(values[None])

    def observe(self, tree: DraftTree, node_idx: torch.Tensor, accepted: torch.Tensor) -> None:
        if not self.model.online or self._last is None or self._last[0].shape != tree.token_ids.shape:
            return
        # used once: `local` may be a view of the drafted tree, whose buffers the next draft reuses once
        # nothing holds them (models/eagle3/workspace.py)
        (local, groups), self._last = self._last, None
        kernels = compiled_values() if tree.batch_size == 1 else None
        if kernels is not None and all(t.device.type == "cpu" for t in (tree.parents, node_idx, accepted)):
            self.state.add_trials(kernels[2], tree.parents[0].numpy(), node_idx[0].numpy(), accepted[0].numpy(),
                                  groups[0], local[0].numpy())
            return
        rows, nodes, _, hit = observed_trials(tree, node_idx, accepted)
        self.state.update(groups[rows, nodes], local.cpu().double().numpy()[rows, nodes], hit)
