"""Timed speculative iterations through the real engine path, for C(k) and C(k, U).

Each timed step is a whole iteration of `SpecEngine._step` (draft -> select ->
verify -> commit) on real prompts, with the selection forced to the top-k draft
nodes by score (the EAGLE-3 order; k = 0 verifies the root alone, a plain step).
The k values are interleaved: every round visits all k = 0..K in a fresh random
order, so machine drift (other jobs, thermal state, context growth) spreads over
all k instead of biasing whichever k happened to be measured last. The same rounds
time a plain step (k = PLAIN: nothing drafted, the engine's speculate-or-not path),
followed by one untimed speculative step so that the drafter's catch-up after it is
never charged to a measured k. One drafter forward is timed apart, on live drafter
caches: (draft with all steps - draft with one step) / (steps - 1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, ClassVar, Iterator

import numpy as np
import torch

from ..core.policies import Selection, SelectionPolicy, _from_tree
from ..core.tree import DraftTree, top_k_nodes
from ..engine.engine import Request
from ..engine.stats import StepStats


PLAIN = -1  # the k of a plain step (no drafting) in the interleaved rounds


class ForcedGuard:
    """The engine's speculate-or-not hook, forced: plain exactly when the forced k is PLAIN."""

    scouts = False  # no first guesses to record

    def __init__(self, policy: "ForcedBudget"):
        self.policy = policy

    def wants_scout(self, speculate: bool) -> bool:
        return False  # no probes, so no scouts

    def start(self, greedy: bool = True, sampling=None, constrained: bool = False) -> "ForcedGuard":
        return self

    def speculate(self) -> bool:
        return self.policy.k != PLAIN

    def observe(self, *args, **kwargs) -> None:
        pass


class ForcedBudget(SelectionPolicy):
    """Verify exactly the top-`k` nodes by score (k set before each step; 0 = root only)."""

    name: ClassVar[str] = "profile-top-k"

    def __init__(self, max_k: int):
        if max_k < 1:
            raise ValueError(f"max_k must be positive, got {max_k}")
        self.max_k = max_k
        self.k = 0

    def select(self, tree: DraftTree, experts=None, root_experts=None, target_scores=None) -> Selection:
        # eagle3's own selection path (policies.Eagle3Policy), at budget k: a step costs what its selection costs
        return _from_tree(top_k_nodes(tree, self.k), None, tree, None)


@dataclass(frozen=True)
class StepSample:
    """One timed iteration."""

    k_requested: int
    verified_tokens: int  # k actually verified (< requested only when the tree was smaller)
    unique_experts: int  # U: unique (layer, expert) pairs woken by the verify forward, root included
    seconds: float  # whole-iteration wall time
    verify_seconds: float


class StepDriver:
    """Steps requests through an engine one iteration at a time, refilling from a prompt list."""

    def __init__(self, engine, make_request: Callable[[list[int]], Request], prompts: list[list[int]], min_remaining: int):
        if not prompts:
            raise ValueError("profiling needs at least one prompt")
        self.engine, self.make_request, self.prompts = engine, make_request, prompts
        self.min_remaining = min_remaining  # start a new request before depth limits shrink the tree
        self._next_prompt = 0
        self._request: Request | None = None
        self._run: Iterator | None = None

    def _start(self) -> None:
        ids = self.prompts[self._next_prompt % len(self.prompts)]
        self._next_prompt += 1
        self._request = self.make_request(ids)
        self._run = self.engine.run(self._request)
        next(self._run)  # prefill + first token (not a timed step)

    def step(self) -> StepStats:
        req = self._request
        if req is None or req.finish_reason is not None or req.max_tokens - len(req.output_ids) < self.min_remaining:
            self._start()
            req = self._request
        before = len(req.steps)
        next(self._run)
        if len(req.steps) != before + 1:
            raise RuntimeError("engine did not record a step")
        return req.steps[-1]


def run_interleaved(driver: StepDriver, policy: ForcedBudget, ks: list[int], rounds: int, warmup_rounds: int,
                    num_moe_layers: int, seed: int = 0, progress=None) -> list[StepSample]:
    """`warmup_rounds + rounds` rounds, each a random permutation of `ks`; warm-up samples are dropped."""
    rng = np.random.default_rng(seed)
    samples: list[StepSample] = []
    for r in range(warmup_rounds + rounds):
        for k in rng.permutation(ks):
            policy.k = int(k)
            s = driver.step()
            if k == PLAIN:
                policy.k = 0
                driver.step()  # untimed: absorbs the drafter's catch-up over the plain step's token
            if progress is not None:
                progress.update(1)
            if r < warmup_rounds:
                continue
            # Under expert parallelism U is U_max (each layer's busiest rank): what a step waits for.
            per_layer = s.unique_experts_per_layer if s.busiest_rank_experts_per_layer is None \
                else s.busiest_rank_experts_per_layer
            samples.append(StepSample(int(k), PLAIN if k == PLAIN else s.verified_tokens,
                                      int(round(per_layer * num_moe_layers)),
                                      s.step_ms / 1e3, s.verify_ms / 1e3))
    return samples


def time_draft_forward(drafter, caches: list, steps: int, topk: int, repeats: int) -> tuple[float, float]:
    """Seconds of one drafter forward while drafting: median over interleaved pairs of
    (draft with `steps` - draft with 1 step) / (steps - 1), on each live cache in turn.
    Returns (median, IQR). Drafting never changes a cache, so repeats see the same state."""
    import time

    if steps < 2:
        raise ValueError("timing a drafter forward needs a tree config with steps >= 2")
    diffs = []
    for r in range(repeats):
        cache = caches[r % len(caches)]
        t0 = time.perf_counter()
        drafter.draft_tree(cache, 1, topk)
        t1 = time.perf_counter()
        drafter.draft_tree(cache, steps, topk)
        t2 = time.perf_counter()
        diffs.append(((t2 - t1) - (t1 - t0)) / (steps - 1))
    d = np.array(trim_values(diffs))
    return float(np.median(d)), float(np.subtract(*np.percentile(d, [75, 25])))


@dataclass(frozen=True)
class CostCurve:
    """Per-k summary of the samples (index = verified tokens k)."""

    median_s: tuple[float, ...]  # C(k) as measured (median of the Tukey-trimmed samples), interpolated where none
    iqr_s: tuple[float, ...]  # inter-quartile range
    mean_unique: tuple[float, ...]  # mean U per k
    count: tuple[int, ...]  # samples per k (after trimming)


def summarize(samples: list[StepSample], max_k: int) -> CostCurve:
    """Group by the verified count; fill a k without samples by linear interpolation."""
    med, iqr, mu, cnt = [], [], [], []
    for k in range(max_k + 1):
        xs = np.array(trim_values(s.seconds for s in samples if s.verified_tokens == k))  # load spikes dropped
        us = np.array([s.unique_experts for s in samples if s.verified_tokens == k])
        cnt.append(len(xs))
        med.append(float(np.median(xs)) if len(xs) else math.nan)
        iqr.append(float(np.subtract(*np.percentile(xs, [75, 25]))) if len(xs) else math.nan)
        mu.append(float(us.mean()) if len(us) else math.nan)
    med_a = np.array(med)
    have = ~np.isnan(med_a)
    if not have.any():
        raise ValueError("no timed steps were recorded")
    ks = np.arange(max_k + 1)
    med_a = np.interp(ks, ks[have], med_a[have])
    return CostCurve(tuple(med_a.tolist()), tuple(iqr), tuple(mu), tuple(cnt))


def monotone(costs: tuple[float, ...]) -> tuple[float, ...]:
    """Non-decreasing fit by pool-adjacent-violators (verifying more never costs less)."""
    blocks: list[list[float]] = []  # [sum, count]
    for c in costs:
        blocks.append([c, 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            s, n = blocks.pop()
            blocks[-1][0] += s
            blocks[-1][1] += n
    out: list[float] = []
    for s, n in blocks:
        out.extend([s / n] * int(n))
    return tuple(out)


def trim_values(xs) -> list[float]:
    """Values inside the Tukey fences (Q1 - 1.5 IQR, Q3 + 1.5 IQR): drops load spikes."""
    xs = list(xs)
    if len(xs) < 4:
        return xs
    q1, q3 = np.percentile(xs, [25, 75])
    lo, hi = q1 - 1.5 * (q3 - q1), q3 + 1.5 * (q3 - q1)
    return [x for x in xs if lo <= x <= hi]


def trim_outliers(samples: list[StepSample]) -> list[StepSample]:
    """Drop steps above the Tukey fence (Q3 + 1.5 IQR) of their k: load spikes from other
    processes, which would otherwise dominate a least-squares fit of C(k, U)."""
    keep = []
    for k in sorted({s.verified_tokens for s in samples}):
        group = [s for s in samples if s.verified_tokens == k]
        q1, q3 = np.percentile([s.seconds for s in group], [25, 75])
        keep += [s for s in group if s.seconds <= q3 + 1.5 * (q3 - q1)]
    return keep


@dataclass(frozen=True)
class NoiseReport:
    """Is the profile steady enough to rank what the policies rank with it?"""

    median_se_s: float  # typical standard error of one C(k) (median over k; SE of a median ~ 0.93 IQR / sqrt(n))
    span_s: float  # C(K) - C(0): the differences evict / joint rank
    plain_gap_s: float | None  # C(0) - plain step: what the k = 0 rule ranks
    ratio: float  # median_se_s / the smaller difference
    verdict: str  # "ok" (ratio <= 0.1), "noisy" (<= 0.25: usable, warn) or "unusable"

    def message(self) -> str:
        gap = "" if self.plain_gap_s is None else f", C(0) - plain = {self.plain_gap_s * 1e3:.2f} ms"
        return (f"noise {self.verdict}: a C(k) is known to +-{self.median_se_s * 1e3:.2f} ms against differences of "
                f"C(K) - C(0) = {self.span_s * 1e3:.2f} ms{gap} (ratio {self.ratio:.2f})")


def standard_error(iqr_s: float, n: int) -> float:
    """Standard error of a median from the IQR of n samples (normal approximation)."""
    return 1.2533 * (iqr_s / 1.349) / math.sqrt(max(n, 1))


def assess_noise(curve: CostCurve, costs: tuple[float, ...], plain_s: float | None,
                 ok: float = 0.1, usable: float = 0.25) -> NoiseReport:
    """Compare the typical C(k) standard error with the differences the profile must rank."""
    ses = [standard_error(q, n) for q, n in zip(curve.iqr_s, curve.count) if n and not math.isnan(q)]
    se = float(np.median(ses)) if ses else math.inf
    span = costs[-1] - costs[0]
    gap = costs[0] - plain_s if plain_s is not None else None
    diffs = [d for d in (span, gap) if d is not None]
    smallest = min(diffs)
    ratio = se / smallest if smallest > 0 else math.inf
    verdict = "ok" if ratio <= ok else "noisy" if ratio <= usable else "unusable"
    return NoiseReport(se, span, gap, ratio, verdict)
