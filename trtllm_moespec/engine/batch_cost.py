"""What a batched step costs, per batch size, and when speculation pays for the batch.

- `BatchCosts`: C_B(k, U) = c0_B + c_tok * k + c_exp * U for a step of B requests verifying k
  draft nodes in all that wake U (layer, expert) pairs. The slopes come from the profiled
  single-request fit (a verified token and a woken expert cost what they cost whoever owns
  them); the intercept c0_B (B drafting runs, B roots, the dense weights) is measured on the
  fly at each batch size: the median over recent speculative steps of
  seconds - c_tok * k - c_exp * U. Before any step at B it is B * c0 (pessimistic: no sharing).
- `GoodputGuard`: speculate or decode plainly (no drafting at all), whichever delivered more
  committed tokens per second at this batch size (an exponential moving average per mode);
  an unmeasured mode is tried first (at a new batch size, plain decoding first when speculation
  lost at the nearest smaller measured one: EcoSpec measures its pay-off shrinking as B grows),
  and the losing mode is re-tried after `probe_every`
  steps, an interval that doubles (up to `max_probe_every`) while the probes keep losing, so a
  change in the text or the context length is noticed without paying for many lost probes.
"""

from __future__ import annotations

import collections
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

    def __init__(self, alpha: float = 0.3, probe_every: int = 16, max_probe_every: int = 256):
        if not 0 < alpha <= 1 or not 2 <= probe_every <= max_probe_every:
            raise ValueError(f"need alpha in (0, 1] and 2 <= probe_every <= max_probe_every, got {alpha}, "
                             f"{probe_every}, {max_probe_every}")
        self.alpha, self.probe_every, self.max_probe_every = alpha, probe_every, max_probe_every
        self._goodput: dict[tuple[int, bool], float] = {}  # (batch size, speculated) -> tokens/s EMA
        self._until_probe: dict[int, int] = {}  # steps left before the losing mode is tried again
        self._interval: dict[int, int] = {}  # current probe interval (doubles while the loser keeps losing)

    def speculate(self, batch_size: int) -> bool:
        spec, plain = self._goodput.get((batch_size, True)), self._goodput.get((batch_size, False))
        if spec is None and plain is None and self._lost_below(batch_size):
            return False  # speculation already lost at a smaller batch; it only gets dearer as B grows
        if spec is None:
            return True
        if plain is None:
            return False
        best = spec >= plain
        return (not best) if self._until_probe.get(batch_size, 0) <= 0 else best

    def record(self, batch_size: int, speculated: bool, tokens: int, seconds: float) -> None:
        before = self._winner(batch_size)
        probed = before is not None and speculated != before
        rate = tokens / max(seconds, 1e-9)
        key = (batch_size, speculated)
        old = self._goodput.get(key)
        self._goodput[key] = rate if old is None else (1 - self.alpha) * old + self.alpha * rate
        after = self._winner(batch_size)
        interval = self._interval.get(batch_size, self.probe_every)
        if probed:  # a probe of the losing mode: back off while it keeps losing, start over when it wins
            interval = min(2 * interval, self.max_probe_every) if after == before else self.probe_every
            self._interval[batch_size] = interval
            self._until_probe[batch_size] = interval
        else:
            self._until_probe[batch_size] = self._until_probe.get(batch_size, interval) - 1

    def _lost_below(self, batch_size: int) -> bool:
        """Speculation lost at the largest smaller batch size where both modes were measured."""
        measured = [b for b in range(batch_size - 1, 0, -1) if self._winner(b) is not None]
        return bool(measured) and self._winner(measured[0]) is False

    def _winner(self, batch_size: int) -> bool | None:
        spec, plain = self._goodput.get((batch_size, True)), self._goodput.get((batch_size, False))
        return None if spec is None or plain is None else spec >= plain
