"""Speculate or not, per step: k = 0 before drafting, and the goodput guard.

Before each step the engine asks the request's `GuardState` whether to speculate.
The answer is `core.drafting.speculation_pays` on running estimates:

- tokens a speculative step commits (EWMA over this request's speculative steps:
  realized acceptance is the best estimate of the selected nodes' value, at T=0 and T>0);
- seconds of a speculative step and of a plain step: with `measured=True` (the goodput
  guard) the wall time of this request's own steps (a profile's plain-step time is not
  trusted: it is measured, first after one speculative step, then again every
  `refresh_every` speculative steps, since the machine's load changes), else the
  profiled costs (`C(k)` of the verified size, and the profile's plain step): the k = 0
  rule alone.

No verdict comes before the engine has measured `min_spec_steps` speculative steps (per kind of
sampling, over requests; a model's sampled prior counts as those, below): one step commits anywhere
from 1 to D+1 tokens and the first ones carry warm-up time. While speculation loses the request
decodes plainly (no drafter forward: the drafter catches up on the skipped tokens in one forward when
drafting resumes) and probes a speculative step every `probe_every` plain steps; a probe that still loses doubles the
interval (up to `max_probe_every`), one that wins re-enables speculation: the text has
become predictable. The interval is never shorter than what keeps a losing probe's extra
time (its seconds beyond decoding the tokens it commits plainly) within a budget share
of the plain decoding time between probes: `probe_overhead` (0.5%), or, for greedy requests
and when larger, `winning_probe_overhead` (10%) times the engine's running probe win rate
(starting at even odds). Where a speculative step costs five plain ones and commits three
tokens, a greedy probe waits ~40 plain steps while half the probes win and ~400 once they
keep losing, so where speculation never pays the guard's product is at most ~0.5% slower
than plain decoding, and where it often pays again a losing verdict is retried soon. At
T > 0 a probe's win is mostly one lucky draw (a sampled step commits 1..D+1 tokens at
random, and the speculation it re-enables then loses again), so sampled requests keep the
fixed budget (on moespec-base this cut T=1's speculative steps, which lose there, from 114 to 47
in ~5650 and left T=0's speed within noise: docs/guard.md). Estimates
and the probe countdown carry over from one request to the next through the engine's
`GuardMemory` (one per kind of sampling: greedy and T > 0 accept differently), so a new
request starts from what the last ones measured, and short requests do not each restart
the countdown. A greedy request's tokens per speculative step start from the engine's mean over
the latest `prior_window` (32) speculative steps, not from the estimate the last request ended
with: that one holds the last request's final steps, and a request ending on text the drafter
cannot predict sent the next one to plain decoding until a probe won. Sampled requests keep the
last estimate, whose bias towards the latest losing probes keeps their probes rare.

Opt-in (`GuardConfig(scout=True)`), a sampled request's probe starts with a scout (`GuardState.scout`): the
drafter's catch-up over the skipped plain steps, which the probe needs anyway, also yields its first guess
at each of them, and a deterministic draft d is accepted with probability p(d), of which 1[committed token
== d] is an unbiased sample at any temperature. The hit rate h of the request's latest 64 guesses predicts
a speculative step's tokens as h x tokens_hit + (1 - h) x tokens_miss (the engine's means over speculative
steps whose first guess hit or missed: ~2.3 and 1.0 at T=1 on moespec-base), and the probe's speculative
step runs only where that pays; a stopped probe costs the catch-up forward alone and counts as a lost one.
It is off by default because side by side it did not make T=1 faster: on moespec-base (joint, 8 prompts x 3
data sets, interleaved) it cut the speculative steps, all losing, from 80 to 13 and from 44 to 36 of ~5650-8580
in two runs, at 0.99x and 0.98x the speed without it (within those cells' noise, but on the same side twice):
where the guard's probes already cost under ~1% of the time, a scout (~8-11 ms, a request's first including
the drafter's prompt prefill) saves about what it costs.

Greedy requests scout by default, differently (`GuardConfig.scout_every`, `GuardState.wants_scout`): while
one decodes plainly, every 8 plain steps once the probe budget would allow a probe, the drafter catches up
on the skipped steps (which the next speculative step needs anyway) and reads whether each committed token
was among its top 2 first guesses. The hit rate h of the plain steps since the last speculative one (their
latest 16) predicts a step's tokens as sum(h^d, d = 0..D) over the drafter's depth D; where that pays, a
probe runs at once, starting from that prediction. (Top-1 hits would not do: at T=0 a step whose first
guess misses still commits ~3.4 tokens, the argmax being another depth-1 draft, and gating greedy probes on
them cut T=0's speculative steps from 68% to 27%.) Blind probes alone failed on moespec-base's GSM8K
answers: an opening of one-token steps sent a request plain, and single-step probes, which commit one token
now and then even where speculation pays, kept losing while their interval doubled past the stretches that
pay (benchmarks/results/base/guard_trace_gsm8k.txt: 119 tokens/s against 131 without the guard). Side by
side in two runs (joint, 8 prompts x 3 data sets, 128 tokens, interleaved: benchmarks/results/base/
guard_scout_t0.txt, then with the variants' order reversed, guard_scout_t0_rev.txt): speculative steps 37 / 56 /
96% -> 72 / 86 / 100% and 79 / 63 / 96% -> 92 / 82 / 98% (GSM8K / MT-Bench / HumanEval); on GSM8K 73.6 -> 89.3
tokens/s in the first run (the guard off: 91.5), within the second's noise. Without scouts the guard's verdicts
rest on step times alone, so how much it declines varies from run to run (GSM8K: 37% and 79% speculative).

`hold` (0.15) adds hysteresis to greedy requests: one that is speculating goes on until speculation loses by
more than that fraction, one decoding plainly resumes only where speculation wins (sampled requests keep the
strict rule: there a probe's win is mostly a lucky draw, and the hold kept the speculation it re-enabled going
while it lost). Measured with
`python -m benchmarks.guard_trace --policy joint --variants "default,guard:hold=0.15,off"` (moespec-base,
4 prompts per data set, 96 tokens, one run per cell: benchmarks/results/base/guard_hold_t*.txt): T=0 80
tokens/s without it, 81 with it (speculating every step: 79), with 71% and 88% of the steps speculative;
T=1 55 -> 54 (the same 0-2 speculative steps per prompt).

A model may ship a prior for sampled requests (`SampledPrior`, its policy_defaults.json's "guard" entry: what an
unguarded run at T=1 on its tree and device committed per speculative step, and what that step cost in plain steps).
Where it applies (an engine's first sampled request at that temperature or above, untruncated, without logit rules or
grammar) the engine's sampled memory starts from it as if it had measured `min_spec_steps` such steps: the request
decodes one plain step, prices a speculative step as the prior's ratio of it, and where that loses never speculates
before its first budgeted probe. Without it an engine's first sampled request spent its first speculative steps
learning what the model could have told it: on moespec-base a one-shot `moespec generate --temperature 1` ran 0.78x
`ar` (three learning steps of ~45 ms that each committed one token, and the first drafting's one-time ~0.3 s). Greedy
requests never use a prior: there speculation pays, and they learn while it does.

Lossless: the decision uses only past steps (their outcomes and timings), never the
current step's random numbers; a plain step is verified by the same rule as `ar`.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field

from ..core.drafting import speculation_pays

# A step's wall time counts as at most this many times the running mean of its kind: one stall of the
# machine (a page fault, a neighbour's burst) must not make plain steps look slow enough that
# speculation seems to pay, which a rarely re-measured plain estimate would then remember for long.
TIME_CLIP = 3.0

# The longest wait between probes, whatever a probe costs: a change of the text (or of the machine's
# load) that would make speculation pay is noticed within this many plain steps.
MAX_PROBE_WAIT = 1024

# Weight of the newest probe in the engine's running probe win rate (and of the newest scout in its pass rate).
PROBE_WIN_WEIGHT = 0.25

# A scout judges on the drafter's latest first guesses (at speculative steps and at the plain steps it caught
# up on): this many at most, the text's recent predictability. With fewer than SCOUT_MIN it cannot judge and
# the probe goes on.
SCOUT_WINDOW = 64
SCOUT_MIN = 8

# A greedy scout counts a hit where the committed token was among the drafter's top 2 first guesses: the tree
# verifies more than the top-1 chain, and greedy steps often accept through a second child (moespec-base, joint,
# 24 prompts x 128 tokens: the hit rate of the 16 tokens before a stretch, turned into tokens per step as
# i.i.d. hits along the tree's depth, correlated 0.66 / 0.75 / 0.72 / 0.70 with what the stretch's speculative
# steps committed for the top 1 / 2 / 3 / 8: `python -m benchmarks.scout_calibration`). It judges on the request's
# latest this many plain steps.
GREEDY_SCOUT_TOP = 2
GREEDY_SCOUT_WINDOW = 16

# Weight of a blind probe's step in the request's tokens-per-step estimate: rare news, let it move the
# estimate enough to re-enable speculation.
PROBE_WEIGHT = 0.5


def steps_to_cover(seconds: float, budget_s: float) -> int:
    """The fewest steps whose overhead budget (`budget_s` seconds each) covers `seconds` (rounded first:
    100.000...01 steps is 100)."""
    return math.ceil(round(seconds / budget_s, 9))


def greedy_scout_tokens(hits, depth: int) -> float | None:
    """A speculative step's tokens per request that a greedy scout's hits predict: with h the share of the
    committed tokens among the drafter's top `GREEDY_SCOUT_TOP` guesses, sum(h^d, d = 0..depth) (hits along
    the tree's depth as independent). None: fewer than SCOUT_MIN hits, or no depth to draft."""
    if len(hits) < SCOUT_MIN or depth < 1:
        return None
    h = sum(hits) / len(hits)
    return sum(h ** d for d in range(depth + 1))


@dataclass(frozen=True)
class SampledPrior:
    """What a model measured of sampled speculation on its tree and device (module docstring): an engine's sampled
    requests start from it instead of learning it with losing speculative steps."""

    tokens_per_step: float  # committed tokens per speculative step of an unguarded run at `temperature`
    step_ratio: float  # that run's seconds per speculative step over `ar`'s per plain step
    temperature: float = 1.0  # requests at this temperature or above, untruncated, start from it

    def __post_init__(self) -> None:
        for name, ok, rule in (("tokens_per_step", lambda v: v >= 1.0, ">= 1 (a step commits its bonus token)"),
                               ("step_ratio", lambda v: v > 0, "> 0"), ("temperature", lambda v: v > 0, "> 0")):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and ok(v)):
                raise ValueError(f"SampledPrior.{name} must be a finite number {rule}, got {v!r}")

    def covers(self, sampling, constrained: bool = False) -> bool:
        """Does the prior describe this request's acceptance? Its temperature or above, no top-k / top-p /
        min-p truncation (which raise acceptance), no logit rules or grammar (`constrained`)."""
        return (not constrained and sampling.temperature >= self.temperature and sampling.top_k == 0
                and sampling.top_p == 1.0 and sampling.min_p == 0.0)


@dataclass(frozen=True)
class GuardConfig:
    """How the speculate-or-not decision is made."""

    measured: bool = True  # goodput guard: wall time of this request's steps (False: profiled costs only)
    probe_every: int = 8  # plain steps between speculative probes while speculation loses
    max_probe_every: int = 64  # cap of the doubling probe interval
    refresh_every: int = 32  # speculative steps between plain steps that re-measure the plain cost
    weight: float = 0.25  # EWMA weight of the newest observation
    margin: float = 0.0  # speculate only when tokens/s beats plain by this fraction
    # Hysteresis: a request that is speculating goes on until speculation's estimated tokens/s falls below
    # plain decoding's by more than this fraction (one decoding plainly resumes only past `margin`). Single
    # steps commit 1..D+1 tokens, so a short run of unlucky ones must not send a request that speculation
    # serves well to plain decoding until a probe brings it back. Greedy requests only: at T > 0 a step's tokens
    # are mostly the luck of the draw, and a probe that drew lucky re-enabled speculation that the hold then kept
    # going while it lost (moespec-base, bench of 774adc4: evict speculated 32 and 26 steps in a row on GSM8K at
    # 1.3 tokens a step; a joint trace, 26 steps committing 1 token each on one MT-Bench prompt, 67 tok/s against
    # 76 without the hold).
    hold: float = 0.15
    probe_overhead: float = 0.005  # a losing probe may cost at most this share of the plain time between probes
    # ... or, for greedy requests, this share times the engine's probe win rate, when larger: where probes often
    # find the text predictable again (greedy decoding that settles into a pattern) one is worth more than where
    # they never do, so the bound relaxes to what probes have earned (0: the fixed bound only). Sampled
    # requests keep the fixed bound: there a probe that wins has mostly drawn lucky.
    winning_probe_overhead: float = 0.1
    # Speculative steps an engine measures (per kind of sampling) before the guard may find that speculation
    # loses: one step commits 1..D+1 tokens, so a verdict on one step could send a request that speculation
    # serves well to plain decoding for hundreds of steps. The times of an engine's first this many steps of
    # each kind (speculative, plain) set its estimate as their median, not their mean: the first steps carry
    # one-time costs (numba caches loading, first allocations). On moespec-base the first speculative step took
    # 359 ms against ~33 ms after it, and the EWMA it started read 168 ms four steps later: the guard found
    # speculation losing and decoded the first prompts plainly until a probe, which that price put ~200 plain
    # steps away.
    min_spec_steps: int = 4
    # Greedy requests start from the engine's mean tokens per speculative step over about its latest `prior_window`
    # speculative steps, not from the estimate the last request ended with (module docstring; 0: that old rule).
    # Sampled requests keep the old rule: with the window, T=1 on moespec-base probed twice as often, all losing.
    prior_window: int = 32
    # Opt-in: scout before each probe of a sampled request (drafters that can: EAGLE-3): the drafter's catch-up
    # over the skipped plain steps reads its first guess at each, and the probe's speculative step runs only
    # where the tokens that hit rate predicts would pay (`GuardState.scout`). A probe the scout stops costs a
    # drafter forward. Off by default: side by side on moespec-base it cut T=1's losing speculative steps but
    # not its time (module docstring). Greedy requests never scout: a step whose first guess misses still
    # commits ~3.4 tokens there (the target's argmax is another depth-1 draft), so the hit rate tells little.
    scout: bool = False
    # A sampled request's probe is priced with the drafter's catch-up before it (its start, or its forward over the
    # tokens the plain steps skipped), which the guard keeps out of its step times: on moespec-base at T=1 that was
    # ~9 ms of a probe's ~15 ms over a plain step, so probes cost ~1.2% of the time against the 0.5% budgeted. Greedy
    # requests keep the step-only price: their probes win often, and their budget is what the wins have earned.
    price_catch_up: bool = True
    # Greedy requests decoding plainly scout every this many plain steps once the probe budget allows a probe
    # (0: never): the drafter catches up on the skipped steps, which the next speculative step needs anyway,
    # reading whether each committed token was among its top 2 first guesses, and where that hit rate predicts
    # speculation pays, a probe runs at once instead of waiting for the doubling interval (`GuardState.scout`;
    # why and what it measured: the module docstring).
    scout_every: int = 8

    def __post_init__(self) -> None:
        if not (isinstance(self.probe_every, int) and 1 <= self.probe_every <= self.max_probe_every):
            raise ValueError(f"probe_every must be an integer in [1, max_probe_every], got {self.probe_every!r}")
        if not 0.0 < self.weight <= 1.0:
            raise ValueError(f"guard weight must lie in (0, 1], got {self.weight}")
        if not (math.isfinite(self.margin) and self.margin >= 0):
            raise ValueError(f"guard margin must be >= 0, got {self.margin}")
        if not 0.0 <= self.hold < 1.0:
            raise ValueError(f"guard hold must lie in [0, 1), got {self.hold}")
        if not 0.0 < self.probe_overhead <= 1.0:
            raise ValueError(f"probe_overhead must lie in (0, 1], got {self.probe_overhead}")
        if not 0.0 <= self.winning_probe_overhead <= 1.0:
            raise ValueError(f"winning_probe_overhead must lie in [0, 1], got {self.winning_probe_overhead}")
        if not (isinstance(self.min_spec_steps, int) and self.min_spec_steps >= 1):
            raise ValueError(f"min_spec_steps must be an integer >= 1, got {self.min_spec_steps!r}")
        if not (isinstance(self.scout_every, int) and self.scout_every >= 0):
            raise ValueError(f"scout_every must be an integer >= 0, got {self.scout_every!r}")
        if not (isinstance(self.prior_window, int) and self.prior_window >= 0):
            raise ValueError(f"prior_window must be an integer >= 0, got {self.prior_window!r}")


@dataclass
class Ewma:
    """Exponentially weighted mean. The first `warmup` observations set it as their median, the
    EWMA goes on from there (0: the first observation sets it)."""

    value: float = math.nan
    count: int = 0
    warmup: int = 0
    first: list[float] = field(default_factory=list, repr=False)  # the warm-up observations

    def update(self, x: float, weight: float, clip: float | None = None) -> None:
        """Add observation x; with `clip`, x counts as at most clip times the current mean (`clipped`)."""
        if self.count < self.warmup:
            self.first.append(x)
            self.value, self.count = statistics.median(self.first), self.count + 1
            return
        x = self.clipped(x, clip)
        self.value = x if self.count == 0 else (1 - weight) * self.value + weight * x
        self.count += 1

    def clipped(self, x: float, clip: float | None) -> float:
        """x as the next observation counts: at most clip times the current mean, once there is a mean past
        the warm-up (the warm-up's median needs no clip)."""
        if clip is None or self.count < max(self.warmup, 1):
            return x
        return min(x, clip * self.value)

    def window_weight(self, window: int) -> float:
        """The weight of the next observation that makes this the plain mean of the first `window`
        observations, then an EWMA over about that many."""
        return max(1.0 / (self.count + 1), 1.0 / window)

    def as_prior(self) -> "Ewma":
        """A request's start from this engine-wide estimate: weighted as one observation, or, while the
        estimate is still in its warm-up, those observations (their median is not trusted yet)."""
        if self.count < self.warmup:
            return Ewma(self.value, self.count, self.warmup, list(self.first))
        return Ewma(self.value, min(self.count, 1))

    @property
    def known(self) -> bool:
        return self.count > 0


@dataclass
class GuardMemory:
    """What one engine's requests have measured so far (the next request's prior)."""

    spec_tokens: Ewma = field(default_factory=Ewma)  # committed tokens per speculative step (greedy: `prior_window`)
    spec_s: Ewma = field(default_factory=Ewma)  # seconds per speculative step
    plain_s: Ewma = field(default_factory=Ewma)  # seconds per plain step
    probe_every: int | None = None
    since_spec: int = 0  # plain steps since the last speculative one, over requests (the probe countdown)
    probe_win_rate: float = 0.5  # running share of probes that re-enabled speculation (prior: even odds)
    # Committed tokens per speculative step when the drafter's first guess was the step's first committed
    # token, and when it was not: what a scout's hit rate is turned into.
    tokens_hit: Ewma = field(default_factory=Ewma)
    tokens_miss: Ewma = field(default_factory=Ewma)
    scout_s: Ewma = field(default_factory=Ewma)  # seconds per scout (its drafter catch-up)
    catch_up_s: Ewma = field(default_factory=Ewma)  # seconds of the drafter's catch-up before a speculative step
    scout_pass_rate: float = 0.5  # running share of scouts that let their probe run (prior: even odds)
    # A model's prior (SampledPrior.step_ratio): a speculative step's seconds as this many plain steps, until measured
    spec_ratio: float | None = None


class Guard:
    """Per-engine factory of per-request guard states (holds the config, costs and memory)."""

    def __init__(self, config: GuardConfig = GuardConfig(), cost_table: tuple[float, ...] | None = None,
                 plain_step_s: float | None = None, prior: SampledPrior | None = None):
        if not config.measured and (cost_table is None or plain_step_s is None):
            raise ValueError("the profiled speculate-or-not rule needs a cost table with a plain-step cost "
                             "(re-profile with `moespec profile`)")
        self.config, self.cost_table, self.plain_step_s = config, cost_table, plain_step_s
        self.prior = prior if config.measured else None  # the profiled rule prices steps from the profile
        self.memories: dict[bool, GuardMemory] = {}  # keyed by greedy (T = 0) or not

    def start(self, greedy: bool = True, sampling=None, constrained: bool = False) -> "GuardState":
        """A request's guard state (`sampling`, `constrained`: whether the model's sampled prior describes it,
        read when the engine's first sampled request starts)."""
        if bool(greedy) not in self.memories:  # step times: the first min_spec_steps of each kind set them
            warm = self.config.min_spec_steps
            memory = GuardMemory(spec_s=Ewma(warmup=warm), plain_s=Ewma(warmup=warm))
            prior = self.prior
            if not greedy and prior is not None and sampling is not None and prior.covers(sampling, constrained):
                memory.spec_tokens = Ewma(prior.tokens_per_step, warm)  # as if min_spec_steps were measured
                memory.spec_ratio = prior.step_ratio
            self.memories[bool(greedy)] = memory
        return GuardState(self, self.memories[bool(greedy)], greedy)


class GuardState:
    """One request's speculate-or-not decisions."""

    def __init__(self, guard: Guard, memory: GuardMemory, greedy: bool = True):
        self.guard, self.config, self.memory, m = guard, guard.config, memory, memory
        self.greedy = greedy
        self.scouts = self.config.scout and not greedy  # probes start with a scout (see GuardConfig.scout)
        # Start from the engine's memory, weighted as one observation: this request's own steps dominate soon.
        self.spec_tokens, self.spec_s, self.plain_s = m.spec_tokens.as_prior(), m.spec_s.as_prior(), m.plain_s.as_prior()
        if not self.config.measured:  # the profiled rule: the profile's plain step, never wall time
            self.plain_s = Ewma(guard.plain_step_s, 1)
        self.probe_every = m.probe_every or self.config.probe_every
        self.since_plain = 0  # speculative steps since the last plain one
        self.probing = False  # the pending speculative step is a probe
        self.num_plain = 0
        self.num_probes = 0
        self.num_scouts_stopped = 0  # probes that their scout stopped
        self.declined = False  # the last verdict was that speculation loses (the hold no longer applies)
        self.first_hits: deque[bool] = deque(maxlen=SCOUT_WINDOW)  # this request's latest first-guess hits
        # Greedy scouts: plain steps since the last scout or speculative step, and the top-2 hits of the plain
        # steps since the last speculative one (their latest GREEDY_SCOUT_WINDOW).
        self.since_scout = 0
        self.plain_hits: deque[bool] = deque(maxlen=GREEDY_SCOUT_WINDOW)
        self.num_scout_probes = 0  # probes a greedy scout called
        self.scout_called = False  # the pending probe is one a greedy scout called

    def pays(self) -> bool | None:
        """Does speculation beat plain decoding on the current estimates? None while unknown (the plain
        cost not measured yet, or fewer than `min_spec_steps` speculative steps seen by the engine)."""
        spec_s = self.spec_seconds()
        if not (self.spec_tokens.known and spec_s is not None and self.plain_s.known):
            return None
        if self.memory.spec_tokens.count < self.config.min_spec_steps:
            return None
        held = self.greedy and not self.declined  # the hold is for greedy requests (GuardConfig.hold)
        margin = self.config.margin - (self.config.hold if held else 0.0)
        return speculation_pays(self.spec_tokens.value, spec_s, self.plain_s.value, margin)

    def spec_seconds(self) -> float | None:
        """Seconds per speculative step: measured, else the model's prior ratio of the measured plain step
        (None: neither yet)."""
        if self.spec_s.known:
            return self.spec_s.value
        ratio = self.memory.spec_ratio
        return ratio * self.plain_s.value if ratio is not None and self.plain_s.known else None

    def speculate(self) -> bool:
        """Decide the next step (before any drafting)."""
        pays = self.pays()
        self.declined = pays is False
        if pays is None:  # learn: speculate until measured, then one plain step if its cost is unknown
            self.probing = False
            if self.memory.spec_ratio is not None and not self.plain_s.known:
                return False  # a prior prices speculation in plain steps: measure one first
            return not self.spec_s.known or self.plain_s.known
        if pays:
            self.probing = False
            # While speculating, now and then measure a plain step again: the machine's load changes.
            return not (self.config.measured and self.since_plain >= self.config.refresh_every)
        self.probing = self.memory.since_spec >= self.probe_interval()
        return self.probing

    def probe_interval(self) -> int:
        """Plain steps between probes: the doubling `probe_every`, or more where a losing probe costs
        more than the overhead budget of that many plain steps (`budget_steps`)."""
        return max(self.probe_every, self.budget_steps())

    def budget_steps(self) -> int:
        """The fewest plain steps between probes that keep a losing probe's cost within the overhead budget
        of those steps (`probe_overhead`, or `winning_probe_overhead` x the probe win rate when larger)."""
        spec_s = self.spec_seconds()
        plain = self.plain_s.value
        loss = math.nan if spec_s is None else spec_s - self.spec_tokens.value * plain
        if not (plain > 0 and loss > 0):
            return 0
        m = self.memory
        if self.config.price_catch_up and not self.greedy and not self.scouts and m.catch_up_s.known:
            loss += m.catch_up_s.value  # what the probe pays before its step (a scout prices its own below)
        if self.scouts and m.scout_s.known:  # a probe is a scout, and a speculative step when it passes
            loss = m.scout_s.value + m.scout_pass_rate * loss
        return self._steps_within_budget(loss)

    def _steps_within_budget(self, seconds: float) -> int:
        """The fewest plain steps whose overhead budget covers `seconds` (at most MAX_PROBE_WAIT)."""
        budget = self.config.probe_overhead
        if self.greedy:  # at T > 0 a probe's win is mostly one lucky draw: no relaxation for it
            budget = max(budget, self.config.winning_probe_overhead * self.memory.probe_win_rate)
        return min(steps_to_cover(seconds, budget * self.plain_s.value), MAX_PROBE_WAIT)

    def scout_interval(self) -> int:
        """Plain steps between a greedy request's scouts: `scout_every`, or more where a scout's seconds (a
        drafter forward: on moespec-tiny a fifth of a plain step) exceed the overhead budget of that many."""
        every, scout_s = self.config.scout_every, self.memory.scout_s
        if not (scout_s.known and self.plain_s.value > 0):
            return every
        return max(every, self._steps_within_budget(scout_s.value))

    @property
    def scout_top(self) -> int:
        """How many of the drafter's first guesses a scout's hit counts (1 for sampled requests, whose hits
        sample the acceptance of a depth-1 draft)."""
        return GREEDY_SCOUT_TOP if self.greedy else 1

    def wants_scout(self, speculate: bool) -> bool:
        """Should the engine scout before this step, given its decision `speculate`? A sampled request's
        probe starts with one (opt-in, `GuardConfig.scout`); a greedy request decoding plainly scouts every
        `scout_every` plain steps once the probe budget would allow a probe (`GuardConfig.scout_every`)."""
        if not self.greedy:
            return speculate and self.probing and self.scouts
        # (scout_interval() >= scout_every: the cheap test first, most plain steps end there)
        every = self.config.scout_every
        return (not speculate and every > 0 and self.declined and self.since_scout >= every
                and self.since_scout >= self.scout_interval() and self.memory.since_spec >= self.budget_steps())

    def scout(self, hits: list[bool], seconds: float, depth: int = 0) -> bool:
        """What the drafter's catch-up read (`hits`: was each skipped step's committed token among its
        `scout_top` first guesses) decides: does this step speculate? `seconds`: the scout's; `depth`: the
        drafter's deepest draft (greedy scouts). Sampled requests: `_scout_probe`; greedy: `_scout_greedy`."""
        self.memory.scout_s.update(seconds, self.config.weight, TIME_CLIP)
        return self._scout_greedy(hits, depth) if self.greedy else self._scout_probe(hits)

    def _scout_greedy(self, hits: list[bool], depth: int) -> bool:
        """A greedy request decoding plainly: the hit rate h of its latest plain steps predicts a speculative
        step's tokens as sum(h^d, d = 0..depth) (hits along the tree's depth as independent). Where that pays,
        the prediction replaces the request's estimate (which holds the steps before the plain stretch) and a
        probe runs now (True). The probe's step then counts at the usual weight (one step's tokens are noisy;
        the scout read up to 16 positions), and the probe is judged won where that step paid by itself, so the
        probe win rate, which sets the overhead budget, tracks how often scouts call right."""
        self.since_scout = 0
        self.plain_hits.extend(hits)
        expected = greedy_scout_tokens(self.plain_hits, depth)
        if expected is None:
            return False
        if not speculation_pays(expected, self.spec_s.value, self.plain_s.value, self.config.margin):
            return False
        self.spec_tokens.update(expected, 1.0)
        self.scout_called = True
        self.probing = True
        self.num_scout_probes += 1
        return True

    def _scout_probe(self, first_hits: list[bool]) -> bool:
        """A probe's first stage: `first_hits`, whether the drafter's first guess hit at each plain step it
        just caught up on (`Eagle3Source.scout`), joins the request's latest ones, and their hit rate h
        predicts a speculative step's tokens, h x tokens_hit + (1 - h) x tokens_miss (the engine's means
        over speculative steps whose first guess hit and missed). True: that pays, or cannot be judged yet
        (too few guesses, or no speculative step of either kind measured), and the probe's speculative
        step runs. False: the probe is over, judged lost at the price of the scout (`GuardMemory.scout_s`)."""
        self.first_hits.extend(first_hits)
        m = self.memory
        expected = self.expected_tokens()
        spec_s = self.spec_seconds()
        passes = expected is None or spec_s is None or speculation_pays(expected, spec_s, self.plain_s.value,
                                                                         self.config.margin)
        m.scout_pass_rate += PROBE_WIN_WEIGHT * (float(passes) - m.scout_pass_rate)
        if not passes:
            self.num_scouts_stopped += 1
            self.probing = False
            self._judge_probe(won=False)
            m.since_spec = 0  # the countdown restarts as after a speculative probe
        return passes

    def expected_tokens(self) -> float | None:
        """Tokens a speculative step would commit now, from the request's latest first-guess hit rate
        (None: fewer than SCOUT_MIN guesses, or no speculative step measured with a hit or with a miss)."""
        m = self.memory
        if len(self.first_hits) < SCOUT_MIN or not (m.tokens_hit.known and m.tokens_miss.known):
            return None
        h = sum(self.first_hits) / len(self.first_hits)
        return h * m.tokens_hit.value + (1.0 - h) * m.tokens_miss.value

    def _judge_probe(self, won: bool) -> None:
        """A probe's verdict: the engine's win rate, and the probe interval (reset on a win, doubled on a loss)."""
        mem = self.memory
        mem.probe_win_rate += PROBE_WIN_WEIGHT * (float(won) - mem.probe_win_rate)
        self.probe_every = self.config.probe_every if won else min(2 * self.probe_every, self.config.max_probe_every)
        mem.probe_every = self.probe_every

    def observe(self, speculated: bool, committed_tokens: int, seconds: float, verified_tokens: int = 0,
                first_hit: bool | None = None, catch_up_s: float = 0.0) -> None:
        """Record a finished step: its committed tokens and wall time (verified_tokens: for profiled costs;
        first_hit, for a speculative step: was the drafter's first guess its first committed token?
        catch_up_s: the drafter's catch-up before a speculative step, kept out of `seconds`; read for
        speculative steps only)."""
        w, mem = self.config.weight, self.memory
        if self.probing and not self.scout_called:
            w = max(w, PROBE_WEIGHT)
        if speculated:
            cost = seconds if self.config.measured else self._profiled_spec_s(verified_tokens)
            self.spec_tokens.update(committed_tokens, w)
            self.spec_s.update(cost, w, TIME_CLIP)
            window = self.config.prior_window if self.greedy else 0
            mem.spec_tokens.update(committed_tokens, mem.spec_tokens.window_weight(window) if window else w)
            mem.spec_s.update(cost, w, TIME_CLIP)
            if catch_up_s > 0:
                mem.catch_up_s.update(catch_up_s, self.config.weight, TIME_CLIP)
            if first_hit is not None:
                self.first_hits.append(first_hit)
                (mem.tokens_hit if first_hit else mem.tokens_miss).update(committed_tokens, self.config.weight)
            if self.probing:
                self.num_probes += 1
                won = self.pays() if not self.scout_called else speculation_pays(
                    committed_tokens, self.spec_s.value, self.plain_s.value, self.config.margin)
                self._judge_probe(won=bool(won))
            self.scout_called = False
            mem.since_spec = 0
            self.since_plain += 1
            self.since_scout = 0
            self.plain_hits.clear()  # a greedy scout judges the plain steps since
        else:
            cost = seconds if self.config.measured else float(self.guard.plain_step_s)
            self.plain_s.update(cost, w, TIME_CLIP)
            mem.plain_s.update(cost, w, TIME_CLIP)
            mem.since_spec += 1
            self.since_scout += 1
            self.since_plain = 0
            self.num_plain += 1
        self.probing = False

    def _profiled_spec_s(self, verified_tokens: int) -> float:
        table = self.guard.cost_table
        return float(table[min(verified_tokens, len(table) - 1)])
