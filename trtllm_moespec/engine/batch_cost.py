"""What a batched step costs, per batch size, and when speculation pays for the batch.

- `BatchCosts`: C_B(k, U) = c0_B + c_tok * k + c_exp * U for a step of B requests verifying k
  draft nodes in all that wake U (layer, expert) pairs. The slopes come from the profiled
  single-request fit (a verified token and a woken expert cost what they cost whoever owns
  them); the intercept c0_B (B drafting runs, B roots, the dense weights) is measured on the
  fly at each batch size: the median over recent speculative steps of
  seconds - c_tok * k - c_exp * U. Before any step at B it is B * c0 (pessimistic: no sharing).
- `BatchTableCosts`: the same for evict-batch on the profiled table: C_B(k) = c0_B + C(k) - C(0).
- `GoodputGuard`: speculate or decode plainly (no drafting at all), whichever delivered more
  committed tokens per second at this batch size (an exponential moving average per mode);
  no verdict against speculation before `min_spec_steps` speculative steps were measured (one step
  commits 1..D+1 tokens per request, and the first ones carry warm-up time);
  a batch size where the two modes were not both measured follows the nearest one where they were
  (neighbouring sizes cost alike); the losing mode is re-tried (one countdown for the whole
  engine, at whatever size the batch has then) after an interval that doubles while its probes
  keep losing and that is never shorter
  than what keeps a probe's extra time within `probe_overhead` of the winner's (a speculative step
  10x dearer than a plain one is probed every ~900 steps at the default 1%: on a compute-bound
  machine a batch's speculative step, which also starts the drafters that plain steps left
  unstarted, costs 10-25 plain steps), so a change in the text or the
  context length is noticed without paying for many lost probes.
"""

from __future__ import annotations

import collections
import math
import statistics

import numpy as np

from ..core.cost import CostTable, ExpertCostModel
from .guard import TIME_CLIP, Ewma


class BatchCosts:
    """Per-batch-size cost models with profiled slopes and measured intercepts."""

    def __init__(self, base: ExpertCostModel, window: int = 32, measure: bool = True):
        self.base = base
        self.window = window
        self.measure = measure  # False: keep c0_B = B * c0 (reproducible selections for tests and analysis)
        self._residuals: dict[int, collections.deque[float]] = {}

    def model(self, batch_size: int) -> ExpertCostModel:
        """C_B as an ExpertCostModel (k and U count the whole batch)."""
        samples = self._residuals.get(batch_size)
        c0 = statistics.median(samples) if samples else batch_size * self.base.c0
        return ExpertCostModel(max(c0, 1e-6), self.base.c_tok, self.base.c_exp)

    def record(self, batch_size: int, num_nodes: int, unique_pairs: int, seconds: float) -> None:
        """One measured speculative step of `batch_size` requests."""
        if not self.measure:
            return
        residual = seconds - self.base.c_tok * num_nodes - self.base.c_exp * unique_pairs
        self._residuals.setdefault(batch_size, collections.deque(maxlen=self.window)).append(residual)


class BatchTableCosts:
    """evict-batch's cost: C_B(k) = c0_B + C(k) - C(0) on the profiled table C (extended past its
    last entry by its mean slope), with the intercept c0_B measured per batch size as in
    `BatchCosts` (before any step at B: B * C(0)); for one request it is the profiled table."""

    def __init__(self, table: CostTable, window: int = 32, measure: bool = True):
        self.costs = np.asarray(table.costs, dtype=np.float64)
        K = self.costs.size - 1
        self._slope = (self.costs[-1] - self.costs[0]) / K if K > 0 else 0.0
        self.window, self.measure = window, measure
        self._residuals: dict[int, collections.deque[float]] = {}

    def extra(self, num_nodes: np.ndarray | int) -> np.ndarray:
        """C(k) - C(0) for k draft nodes in the batch (past the table: its mean slope per node)."""
        k = np.asarray(num_nodes)
        K = self.costs.size - 1
        return self.costs[np.minimum(k, K)] - self.costs[0] + self._slope * np.maximum(k - K, 0)

    def table(self, batch_size: int, max_nodes: int) -> np.ndarray:
        """C_B(k) for k = 0..max_nodes, seconds."""
        samples = self._residuals.get(batch_size)
        c0 = statistics.median(samples) if samples else batch_size * self.costs[0]
        return np.maximum(c0 + self.extra(np.arange(max_nodes + 1)), 1e-6)

    def record(self, batch_size: int, num_nodes: int, unique_pairs: int, seconds: float) -> None:
        """One measured speculative step of `batch_size` requests (unique_pairs unused: C(k) has no U)."""
        if not self.measure:
            return
        residual = seconds - float(self.extra(num_nodes))
        self._residuals.setdefault(batch_size, collections.deque(maxlen=self.window)).append(residual)


class GoodputGuard:
    """Chooses per step between speculative and plain decoding by measured goodput.

    Goodput is measured per batch size; a batch size where only one mode (or none) was measured
    follows the nearest batch size where both were, and the probe schedule is one countdown for
    the whole engine: under continuous batching the size drifts (8, 7, 8, 6, ...) every few
    steps, and a probe per newly seen size would cost more than all the plain steps it saves.
    """

    def __init__(self, alpha: float = 0.3, probe_every: int = 16, max_probe_every: int = 1024,
                 probe_overhead: float = 0.01, min_spec_steps: int = 4):
        if not 0 < alpha <= 1 or not 2 <= probe_every <= max_probe_every or not 0 < probe_overhead < 1:
            raise ValueError(f"need alpha in (0, 1], 2 <= probe_every <= max_probe_every and probe_overhead in "
                             f"(0, 1), got {alpha}, {probe_every}, {max_probe_every}, {probe_overhead}")
        if not (isinstance(min_spec_steps, int) and min_spec_steps >= 1):
            raise ValueError(f"min_spec_steps must be an integer >= 1, got {min_spec_steps!r}")
        self.alpha, self.probe_every, self.max_probe_every = alpha, probe_every, max_probe_every
        self.probe_overhead = probe_overhead  # a probe may cost at most this share of the winner's time
        # Speculative steps measured before speculation may be found to lose (the single-request guard's
        # `min_spec_steps`): one step commits anywhere from 1 to D+1 tokens per request, and a verdict on the
        # first one sent batches that speculation serves at 1.3x to plain decoding for the next ~90 steps.
        self.min_spec_steps = min_spec_steps
        self.num_spec_steps = 0
        # (batch size, speculated) -> tokens/s and step seconds EMAs, each the median of its first
        # `min_spec_steps` observations before (one-time costs of the first steps: `GuardConfig.min_spec_steps`)
        self._goodput: dict[tuple[int, bool], Ewma] = {}
        self._seconds: dict[tuple[int, bool], Ewma] = {}
        self._until_probe = probe_every  # steps left before the losing mode is tried again
        self._interval = probe_every  # current probe interval (doubles while the loser keeps losing)
        self.num_probes = 0
        self._decisions: dict[int, bool | None] = {}  # batch size -> `_decision`, until the next record

    def speculate(self, batch_size: int) -> bool:
        """Speculate on the next step of `batch_size` requests? Decided before any drafting."""
        decision = self._decision(batch_size)
        if decision is None:  # nothing decided anywhere yet: measure speculation, then plain decoding
            if (batch_size, True) in self._goodput or (batch_size, False) in self._goodput:
                return (batch_size, True) not in self._goodput
            return not any(speculated for _, speculated in self._goodput)
        if self._learning:  # both measured, speculation too few times to be judged: keep measuring it
            return True
        return (not decision) if self._until_probe <= 0 else decision

    @property
    def _learning(self) -> bool:
        return self.num_spec_steps < self.min_spec_steps

    def record(self, batch_size: int, speculated: bool, tokens: int, seconds: float) -> None:
        """One finished step: its mode, committed tokens (all requests) and wall seconds."""
        before = self._decision(batch_size)
        probed = before is not None and speculated != before and not self._learning
        self.num_spec_steps += speculated
        winner = self._goodput[(self._nearest_measured(batch_size), before)].value if probed else 0.0
        key = (batch_size, speculated)
        mean_s = self._seconds.setdefault(key, Ewma(warmup=self.min_spec_steps))
        seconds = mean_s.clipped(seconds, TIME_CLIP)  # one stalled step counts as at most TIME_CLIP times the mean
        self._goodput.setdefault(key, Ewma(warmup=self.min_spec_steps)).update(tokens / max(seconds, 1e-9), self.alpha)
        mean_s.update(seconds, self.alpha)
        self._decisions.clear()
        after = self._decision(batch_size)
        if probed:  # a probe of the losing mode: back off while it keeps losing, start over when it wins
            self.num_probes += 1
            # A probe that beat the winner's estimate without flipping the decision yet (the estimate
            # averages older steps) is news too: no back-off, probe again after the shortest interval.
            promising = after != before or tokens / max(seconds, 1e-9) >= winner
            self._interval = self.probe_every if promising else min(2 * self._interval, self.max_probe_every)
            self._until_probe = max(self._interval, self._affordable_interval(batch_size))
        elif (before is None and after is not None) or (speculated and self.num_spec_steps == self.min_spec_steps):
            # both modes just got measured, or speculation just enough times: the countdown starts
            self._until_probe = max(self._interval, self._affordable_interval(batch_size))
        else:
            self._until_probe -= 1

    def _affordable_interval(self, batch_size: int) -> int:
        """Steps between probes so that a probe's extra time stays within `probe_overhead` of the
        winner's time over the interval (a probe 10x dearer than a step waits ~180 steps at 5%, ~450 at 2%)."""
        measured = self._nearest_measured(batch_size)
        if measured is None:
            return self.probe_every
        winner = self._winner(measured)
        t_win, t_lose = self._seconds[(measured, winner)].value, self._seconds[(measured, not winner)].value
        if t_lose <= t_win:
            return self.probe_every
        return min(math.ceil((t_lose / t_win - 1) / self.probe_overhead), self.max_probe_every)

    def _decision(self, batch_size: int) -> bool | None:
        """The winning mode at the nearest batch size where both modes were measured (this one
        first, then smaller on ties: neighbouring sizes cost alike); None while there is none.
        Kept per batch size until the next `record` changes the measurements (asked every step)."""
        if batch_size not in self._decisions:
            measured = self._nearest_measured(batch_size)
            self._decisions[batch_size] = None if measured is None else self._winner(measured)
        return self._decisions[batch_size]

    def _nearest_measured(self, batch_size: int) -> int | None:
        sizes = sorted((abs(b - batch_size), b) for b, _ in self._goodput if self._winner(b) is not None)
        return sizes[0][1] if sizes else None

    def _winner(self, batch_size: int) -> bool | None:
        spec, plain = (self._goodput[(batch_size, m)].value if (batch_size, m) in self._goodput else None
                       for m in (True, False))
        return None if spec is None or plain is None else spec >= plain
