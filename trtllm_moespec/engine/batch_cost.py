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
  keep losing and that is never shorter than what keeps a probe's extra time (its seconds beyond what
  the winning mode needs for the tokens it commits) within `probe_overhead` of the winner's time (a
  speculative step 10x dearer than a plain one that commits as many tokens is probed every ~900 steps
  at the default 1%: on a compute-bound machine a batch's speculative step, which also starts the
  drafters that plain steps left unstarted, costs 10-25 plain steps), so a change in the text or the
  context length is noticed without paying for many lost probes.
  A batch of greedy requests gets the single-request guard's rules for greedy requests too
  (`engine/guard.py`): the hysteresis `hold` (a speculating batch goes on until speculation loses by
  more than 15%), a budget for probing speculation of `winning_probe_overhead` (10%) times the running
  probe win rate where that is larger, and scouts: while the batch decodes plainly, every `scout_every`
  (8) plain steps once a probe would be affordable, the drafters catch up on the skipped steps reading
  whether each committed token was among their top 2 guesses, and where that hit rate says speculation
  pays the batch speculates at once. moespec-base, 24 data-set requests served through B slots, joint-batch,
  T=0 (`benchmarks/batch_guard_ab.py`, docs/serving.md): 1.60 / 1.34 / 1.17x `ar` at B = 1 / 4 / 8 against
  1.28 / 1.32 / 1.17x without these rules (speculating every step: 1.63 / 1.34 / 1.05x); at T=1, where the
  rules do not apply, 1.01 / 0.99 / 0.99x (speculating every step: 0.70 / 0.63 / 0.58x).
- `GuardsByKind`: the batched engine's default, one GoodputGuard for all-greedy batches and one for the rest,
  the sampled one starting from the model's `SampledPrior` (engine/guard.py) where it describes the batch.
"""

from __future__ import annotations

import collections
import math
import statistics

import numpy as np

from ..core.cost import CostTable, ExpertCostModel
from .guard import (GREEDY_SCOUT_WINDOW, PROBE_WIN_WEIGHT, TIME_CLIP, Ewma, SampledPrior, greedy_scout_tokens,
                    steps_to_cover)


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

    A batch whose requests are all greedy gets the single-request guard's rules for greedy requests
    (`engine/guard.py`): the hysteresis `hold`, a probe budget that grows with the probe win rate
    (`winning_probe_overhead`), and scouts (`wants_scout`, `scout`): serving moespec-base's data-set
    prompts one at a time (B = 1), the batch guard speculated in 19% of the steps without them and in 59%
    with them (the module docstring has the speeds).
    """

    def __init__(self, alpha: float = 0.3, probe_every: int = 16, max_probe_every: int = 1024,
                 probe_overhead: float = 0.01, min_spec_steps: int = 4, hold: float = 0.15,
                 winning_probe_overhead: float = 0.1, scout_every: int = 8, prior: SampledPrior | None = None):
        if not 0 < alpha <= 1 or not 2 <= probe_every <= max_probe_every or not 0 < probe_overhead < 1:
            raise ValueError(f"need alpha in (0, 1], 2 <= probe_every <= max_probe_every and probe_overhead in "
                             f"(0, 1), got {alpha}, {probe_every}, {max_probe_every}, {probe_overhead}")
        if not (isinstance(min_spec_steps, int) and min_spec_steps >= 1):
            raise ValueError(f"min_spec_steps must be an integer >= 1, got {min_spec_steps!r}")
        if not (0.0 <= hold < 1.0 and 0.0 <= winning_probe_overhead <= 1.0):
            raise ValueError(f"need hold in [0, 1) and winning_probe_overhead in [0, 1], got {hold}, "
                             f"{winning_probe_overhead}")
        if not (isinstance(scout_every, int) and scout_every >= 0):
            raise ValueError(f"scout_every must be an integer >= 0, got {scout_every!r}")
        self.alpha, self.probe_every, self.max_probe_every = alpha, probe_every, max_probe_every
        self.probe_overhead = probe_overhead  # a probe may cost at most this share of the winner's time
        self.hold, self.winning_probe_overhead, self.scout_every = hold, winning_probe_overhead, scout_every
        # Speculative steps measured before speculation may be found to lose (the single-request guard's
        # `min_spec_steps`): one step commits anywhere from 1 to D+1 tokens per request, and a verdict on the
        # first one sent batches that speculation serves at 1.3x to plain decoding for the next ~90 steps.
        self.min_spec_steps = min_spec_steps
        self.num_spec_steps = 0
        # A model's prior for sampled batches (engine/guard.py `SampledPrior`): the first plain step's time
        # prices a speculative step, which counts as `min_spec_steps` measured ones (`_prime`), instead of
        # speculative steps spent learning that speculation loses.
        self.prior = prior
        # (batch size, speculated) -> tokens/s and step seconds EMAs, each the median of its first
        # `min_spec_steps` observations before (one-time costs of the first steps: `GuardConfig.min_spec_steps`)
        self._goodput: dict[tuple[int, bool], Ewma] = {}
        self._seconds: dict[tuple[int, bool], Ewma] = {}
        self._until_probe = probe_every  # steps left before the losing mode is tried again
        self._interval = probe_every  # current probe interval (doubles while the loser keeps losing)
        self.num_probes = 0
        # greedy batches: the last verdict was speculation (the hold applies), the running share of probes
        # that won (prior: even odds), and the scouts' state
        self._held = False
        self.probe_win_rate = 0.5
        # The running share of scouts that called a probe that won (prior: even odds); it sets their budget. A
        # batch's scout costs a drafter catch-up per request, and where speculation never pays (moespec-tiny)
        # scouts at the probes' budget cost ~4% of the time (`benchmarks/batch_guard_ab.py`, B = 1 / 4 / 8:
        # 0.91 / 0.95 / 0.94x `ar` against 0.97 / 0.98 / 1.00x without the greedy rules).
        self.scout_win_rate = 0.5
        self._since_spec = 0  # plain steps since the last speculative one
        self._since_scout = 0  # plain steps since the last scout or speculative step
        self._hits: collections.deque[bool] = collections.deque(maxlen=GREEDY_SCOUT_WINDOW * 64)
        self._scout_s = Ewma()
        self._scout_called = False  # the pending speculative step is one a scout called
        self.num_scouts = self.num_scout_probes = 0
        self._decisions: dict[tuple[int, bool], bool | None] = {}  # (batch size, greedy) -> `_decision`

    def speculate(self, batch_size: int, greedy: bool = False) -> bool:
        """Speculate on the next step of `batch_size` requests (`greedy`: all of them at T = 0)? Decided
        before any drafting."""
        decision = self._decision(batch_size, greedy)
        if decision is None:  # nothing decided anywhere yet: measure speculation, then plain decoding
            if self.prior is not None and not self._goodput:
                return False  # the prior prices speculation in plain steps: measure one first
            if (batch_size, True) in self._goodput or (batch_size, False) in self._goodput:
                return (batch_size, True) not in self._goodput
            return not any(speculated for _, speculated in self._goodput)
        if self._learning:  # both measured, speculation too few times to be judged: keep measuring it
            return True
        return (not decision) if self._until_probe <= 0 else decision

    @property
    def _learning(self) -> bool:
        return self.num_spec_steps < self.min_spec_steps

    def record(self, batch_size: int, speculated: bool, tokens: int, seconds: float, greedy: bool = False) -> None:
        """One finished step: its mode, committed tokens (all requests) and wall seconds."""
        before = self._decision(batch_size, greedy)
        probed = before is not None and speculated != before and not self._learning
        self.num_spec_steps += speculated
        measured = self._nearest_measured(batch_size) if probed or self._scout_called else None
        winner = self._rate(measured, before) if probed else 0.0
        plain = self._rate(measured, False) if measured is not None and self._scout_called else math.inf
        key = (batch_size, speculated)
        mean_s = self._seconds.setdefault(key, Ewma(warmup=self.min_spec_steps))
        seconds = mean_s.clipped(seconds, TIME_CLIP)  # one stalled step counts as at most TIME_CLIP times the mean
        goodput = tokens / max(seconds, 1e-9)
        self._goodput.setdefault(key, Ewma(warmup=self.min_spec_steps)).update(goodput, self.alpha)
        mean_s.update(seconds, self.alpha)
        if self.prior is not None and not speculated and not any(spec for _, spec in self._goodput):
            self._prime(batch_size)
        self._decisions.clear()
        after = self._decision(batch_size, greedy)
        self._held = bool(after)
        if speculated:
            self._since_spec = self._since_scout = 0
            self._hits.clear()  # a scout judges the plain steps since
        else:
            self._since_spec += 1
            self._since_scout += 1
        if self._scout_called:  # won where its own step paid (the scout's prediction set the estimate)
            self._scout_called = False
            self._judge_probe(goodput > plain, batch_size, greedy)
            self._judge_scout(goodput > plain)
        elif probed:  # a probe of the losing mode: back off while it keeps losing, start over when it wins
            # A probe that beat the winner's estimate without flipping the decision yet (the estimate
            # averages older steps) is news too: no back-off, probe again after the shortest interval.
            self._judge_probe(after != before or goodput >= winner, batch_size, greedy, speculation=speculated)
        elif (before is None and after is not None) or (speculated and self.num_spec_steps == self.min_spec_steps):
            # both modes just got measured, or speculation just enough times: the countdown starts
            self._until_probe = max(self._interval, self._affordable_interval(batch_size, greedy))
        else:
            self._until_probe -= 1

    def _prime(self, batch_size: int) -> None:
        """Speculation's estimates at `batch_size` from the prior and the plain step just measured there, as if
        `min_spec_steps` speculative steps had been: seconds = step_ratio x plain, tokens = batch x tokens_per_step.
        Measured steps then move them as the EWMA moves any estimate."""
        spec_s = self.prior.step_ratio * self._seconds[(batch_size, False)].value
        tokens = batch_size * self.prior.tokens_per_step
        self._seconds[(batch_size, True)] = Ewma(spec_s, self.min_spec_steps)
        self._goodput[(batch_size, True)] = Ewma(tokens / spec_s, self.min_spec_steps)
        self.num_spec_steps = max(self.num_spec_steps, self.min_spec_steps)

    def of(self, greedy: bool, requests) -> "GoodputGuard":
        """The guard deciding a batch: this one, whatever its kind (`GuardsByKind.of` keeps one per kind)."""
        return self

    def _judge_probe(self, won: bool, batch_size: int, greedy: bool, speculation: bool = True) -> None:
        """A probe's verdict: the interval (reset on a win, doubled on a loss), the countdown, and for a
        probe of speculation the win rate that sets a greedy batch's probe budget."""
        self.num_probes += 1
        if speculation:
            self.probe_win_rate += PROBE_WIN_WEIGHT * (float(won) - self.probe_win_rate)
        self._interval = self.probe_every if won else min(2 * self._interval, self.max_probe_every)
        self._until_probe = max(self._interval, self._affordable_interval(batch_size, greedy))

    def _judge_scout(self, won: bool) -> None:
        """A scout's verdict: it called a probe that won, or not (a probe that lost, or no probe)."""
        self.scout_win_rate += PROBE_WIN_WEIGHT * (float(won) - self.scout_win_rate)

    def _budget(self, greedy: bool, speculation: bool) -> float:
        """The share of the winner's time a probe may cost: for a probe of speculation in a greedy batch,
        relaxed to what probes have earned (`winning_probe_overhead` x the win rate) when that is larger."""
        if greedy and speculation:
            return max(self.probe_overhead, self.winning_probe_overhead * self.probe_win_rate)
        return self.probe_overhead

    def _affordable_interval(self, batch_size: int, greedy: bool = False) -> int:
        """Steps between probes so that a probe's extra time (its seconds beyond what the winning mode needs
        for the tokens it commits) stays within the budget share of the winner's time over the interval:
        a probe 10x dearer than a step that commits as many tokens waits ~180 steps at 5%, ~450 at 2%."""
        measured = self._nearest_measured(batch_size)
        if measured is None:
            return self.probe_every
        winner = self._winner(measured, greedy)
        t_win, t_lose = self._seconds[(measured, winner)].value, self._seconds[(measured, not winner)].value
        loss = t_lose * (1.0 - self._rate(measured, not winner) / self._rate(measured, winner))
        if loss <= 0:
            return self.probe_every
        return min(steps_to_cover(loss, self._budget(greedy, not winner) * t_win), self.max_probe_every)

    # ------------------------------------------------------------------ scouts (greedy batches)
    def wants_scout(self, batch_size: int, greedy: bool) -> bool:
        """Should the engine scout before this plain step? A greedy batch decoding plainly scouts every
        `scout_every` plain steps, once a probe would be affordable (the single-request guard's
        `GuardState.wants_scout`), or less often where a scout costs more than its budget of those steps'
        time allows: `winning_probe_overhead` x the share of scouts that called a winning probe, at least
        `probe_overhead`."""
        if not (greedy and self.scout_every > 0 and self._since_scout >= self.scout_every) or self._learning:
            return False
        if self._decision(batch_size, greedy) is not False:
            return False
        if self._since_spec < self._affordable_interval(batch_size, greedy):
            return False
        if not self._scout_s.known:
            return True
        # a scout (the drafters' catch-up) within the budget of the plain steps between
        share = max(self.probe_overhead, self.winning_probe_overhead * self.scout_win_rate)
        t_plain = self._seconds[(self._nearest_measured(batch_size), False)].value
        return self._since_scout >= steps_to_cover(self._scout_s.value, share * t_plain)

    def scout(self, batch_size: int, hits: list[bool], seconds: float, depth: int) -> bool:
        """What the drafters' catch-up read (`hits`: was each skipped step's committed token among a drafter's
        top `GREEDY_SCOUT_TOP` first guesses, over the batch's requests) decides: does this step speculate?
        The hit rate h of the latest plain steps' guesses (GREEDY_SCOUT_WINDOW per request) predicts a
        speculative step's tokens per request as sum(h^d, d = 0..depth); where that pays, the prediction
        replaces the speculative estimate and the step runs as a probe, judged by what it commits."""
        self._scout_s.update(seconds, self.alpha, TIME_CLIP)
        self._since_scout = 0
        self.num_scouts += 1
        self._hits.extend(hits)
        per_request = greedy_scout_tokens(list(self._hits)[-GREEDY_SCOUT_WINDOW * batch_size:], depth)
        measured = self._nearest_measured(batch_size)
        if per_request is None or measured is None:
            self._judge_scout(False)
            return False
        goodput = measured * per_request / self._seconds[(measured, True)].value  # a speculative step at `measured`
        if goodput <= self._rate(measured, False):
            self._judge_scout(False)
            return False
        self._goodput[(measured, True)].value = goodput
        self._decisions.clear()
        self._scout_called = True
        self.num_scout_probes += 1
        return True

    # ------------------------------------------------------------------ the estimates
    def _rate(self, batch_size: int, speculated: bool) -> float:
        """Tokens per second of one mode at a batch size where it was measured."""
        return self._goodput[(batch_size, speculated)].value

    def _decision(self, batch_size: int, greedy: bool = False) -> bool | None:
        """The winning mode at the nearest batch size where both modes were measured (this one
        first, then smaller on ties: neighbouring sizes cost alike); None while there is none.
        Kept per batch size until the next `record` changes the measurements (asked every step)."""
        key = (batch_size, greedy)
        if key not in self._decisions:
            measured = self._nearest_measured(batch_size)
            self._decisions[key] = None if measured is None else self._winner(measured, greedy)
        return self._decisions[key]

    def _nearest_measured(self, batch_size: int) -> int | None:
        sizes = sorted((abs(b - batch_size), b) for b, spec in self._goodput if spec and (b, False) in self._goodput)
        return sizes[0][1] if sizes else None

    def _winner(self, batch_size: int, greedy: bool = False) -> bool:
        """Speculation wins at a batch size where both modes were measured; for a greedy batch that was
        speculating, until it loses by more than `hold` (the single-request guard's `GuardConfig.hold`)."""
        margin = self.hold if greedy and self._held else 0.0
        return self._rate(batch_size, True) >= (1.0 - margin) * self._rate(batch_size, False)


class GuardsByKind:
    """The batched engine's default guard: one `GoodputGuard` for batches of greedy requests and one for the
    others, as the single-request guard keeps greedy and sampled memories apart (engine/guard.py). They accept
    differently (moespec-base, joint: ~4 tokens per speculative step at T=0, ~1.3 at T=1), so one set of
    estimates shared by both would send a server's greedy batches plain after its sampled ones measured a loss,
    and back. The sampled guard starts from the model's `SampledPrior` where the first batch it decides for is one
    the prior describes (every request at the prior's temperature or above, untruncated, unconstrained)."""

    def __init__(self, prior: SampledPrior | None = None):
        self.prior = prior
        self.guards: dict[bool, GoodputGuard] = {}

    def of(self, greedy: bool, requests) -> GoodputGuard:
        """The guard for a batch that is all greedy or not; `requests` (an iterable of engine.Request) are read
        only when the sampled guard is made."""
        if greedy not in self.guards:
            p = self.prior
            covered = not greedy and p is not None and all(p.covers(r.sampling, r.constrained) for r in requests)
            self.guards[greedy] = GoodputGuard(prior=p if covered else None)
        return self.guards[greedy]
