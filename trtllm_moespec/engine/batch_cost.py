"""What a batched step costs, per batch size, and when speculation pays for the batch.

- `BatchCosts`: C_B(k, U) = c0_B + c_tok * k + c_exp * U for a step of B requests verifying k
  draft nodes in all that wake U (layer, expert) pairs. The slopes come from the profiled
  single-request fit (a verified token and a woken expert cost what they cost whoever owns
  them); the intercept c0_B (B drafting runs, B roots, the dense weights) is measured on the
  fly at each batch size: the median over recent speculative steps of
  seconds - c_tok * k - c_exp * U. Before any step at B it is B * c0 (pessimistic: no sharing).
- `GoodputGuard`: speculate or decode plainly (no drafting at all), whichever delivered more
  committed tokens per second at this batch size (an exponential moving average per mode);
  at a batch size never seen, the mode that won at the nearest measured batch size goes first
  (neighbouring sizes cost alike); an unmeasured mode is then tried once, and the losing mode is
  re-tried after an interval that doubles while its probes keep losing and that is never shorter
  than what keeps a probe's extra time within `probe_overhead` of the winner's (a speculative step
  10x dearer than a plain one is probed every ~180 steps at 5%), so a change in the text or the
  context length is noticed without paying for many lost probes.
"""

from __future__ import annotations

import collections
import math
import statistics

from ..core.cost import ExpertCostModel


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


class GoodputGuard:
    """Chooses per step between speculative and plain decoding by measured goodput."""

    def __init__(self, alpha: float = 0.3, probe_every: int = 16, max_probe_every: int = 1024,
                 probe_overhead: float = 0.05):
        if not 0 < alpha <= 1 or not 2 <= probe_every <= max_probe_every or not 0 < probe_overhead < 1:
            raise ValueError(f"need alpha in (0, 1], 2 <= probe_every <= max_probe_every and probe_overhead in "
                             f"(0, 1), got {alpha}, {probe_every}, {max_probe_every}, {probe_overhead}")
        self.alpha, self.probe_every, self.max_probe_every = alpha, probe_every, max_probe_every
        self.probe_overhead = probe_overhead  # a probe may cost at most this share of the winner's time
        self._goodput: dict[tuple[int, bool], float] = {}  # (batch size, speculated) -> tokens/s EMA
        self._seconds: dict[tuple[int, bool], float] = {}  # (batch size, speculated) -> step seconds EMA
        self._until_probe: dict[int, int] = {}  # steps left before the losing mode is tried again
        self._interval: dict[int, int] = {}  # current probe interval (doubles while the loser keeps losing)

    def speculate(self, batch_size: int) -> bool:
        spec, plain = self._goodput.get((batch_size, True)), self._goodput.get((batch_size, False))
        if spec is None and plain is None:
            nearest = self._nearest_decided(batch_size)
            return True if nearest is None else nearest  # neighbouring batch sizes cost alike
        if spec is None:
            return True
        if plain is None:
            return False
        best = spec >= plain
        return (not best) if self._until_probe.get(batch_size, 0) <= 0 else best

    def record(self, batch_size: int, speculated: bool, tokens: int, seconds: float) -> None:
        before = self._winner(batch_size)
        probed = before is not None and speculated != before
        key = (batch_size, speculated)
        self._goodput[key] = self._ema(self._goodput.get(key), tokens / max(seconds, 1e-9))
        self._seconds[key] = self._ema(self._seconds.get(key), seconds)
        after = self._winner(batch_size)
        interval = self._interval.get(batch_size, self.probe_every)
        if probed:  # a probe of the losing mode: back off while it keeps losing, start over when it wins
            interval = min(2 * interval, self.max_probe_every) if after == before else self.probe_every
            self._interval[batch_size] = interval
            self._until_probe[batch_size] = max(interval, self._affordable_interval(batch_size))
        elif before is None and after is not None:  # both modes just got measured
            self._until_probe[batch_size] = max(interval, self._affordable_interval(batch_size))
        else:
            self._until_probe[batch_size] = self._until_probe.get(batch_size, interval) - 1

    def _ema(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.alpha) * old + self.alpha * new

    def _affordable_interval(self, batch_size: int) -> int:
        """Steps between probes so that a probe's extra time stays within `probe_overhead` of the
        winner's time over the interval (a probe 10x dearer than a step waits ~180 steps at 5%)."""
        winner = self._winner(batch_size)
        t_win, t_lose = self._seconds.get((batch_size, winner)), self._seconds.get((batch_size, not winner))
        if winner is None or t_win is None or t_lose is None or t_lose <= t_win:
            return self.probe_every
        return min(math.ceil((t_lose / t_win - 1) / self.probe_overhead), self.max_probe_every)

    def _nearest_decided(self, batch_size: int) -> bool | None:
        """The winning mode at the nearest batch size where both were measured (smaller first on ties)."""
        decided = sorted((abs(b - batch_size), b) for b in {b for b, _ in self._goodput} if self._winner(b) is not None)
        return self._winner(decided[0][1]) if decided else None

    def _winner(self, batch_size: int) -> bool | None:
        spec, plain = self._goodput.get((batch_size, True)), self._goodput.get((batch_size, False))
        return None if spec is None or plain is None else spec >= plain
