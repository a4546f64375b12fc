"""The guard's scout (engine/guard.py `GuardState.scout`, engine/drafters.py `Eagle3Source.scout`): before a
probe, the drafter's catch-up over the skipped plain steps reads its first guess at each, and the probe's
speculative step runs only where the hit rate predicts that speculating pays."""

from __future__ import annotations

import math
import time

import torch

from tests.engine.conftest import forced_speculation
from trtllm_moespec import LLM, SamplingParams
from trtllm_moespec.engine.guard import SCOUT_MIN, Guard, GuardConfig


def _declined(config: GuardConfig = GuardConfig(probe_every=2, max_probe_every=8, probe_overhead=1.0,
                                                 min_spec_steps=1, scout=True)):
    """A request whose speculative steps commit 4 tokens when the first guess hits and 1 when it misses, at
    3 plain steps' cost each (break-even: 3 tokens, a hit rate of 2/3), after mostly misses: speculation
    loses, so the guard decodes plainly and probes."""
    s = Guard(config).start(greedy=False)
    s.observe(True, 4, 0.030, first_hit=True)
    for _ in range(3):
        s.observe(True, 1, 0.030, first_hit=False)
    s.observe(False, 1, 0.010)
    assert s.expected_tokens() is None  # 4 guesses: too few to judge
    return s


def _until_probe(s) -> None:
    while not s.speculate():
        s.observe(False, 1, 0.010)
    assert s.probing


def test_a_scout_stops_a_probe_where_the_first_guesses_predict_a_loss():
    s = _declined()
    assert s.scouts
    _until_probe(s)
    assert not s.scout([False] * 10, seconds=0.001)  # 1 hit in 14: ~1.2 tokens expected, 3 needed
    assert s.expected_tokens() == 1 / 14 * 4 + 13 / 14 * 1
    assert not s.probing and s.num_scouts_stopped == 1
    assert s.probe_every == 4 and s.memory.since_spec == 0  # judged as a losing probe: the interval doubles
    assert not s.speculate()  # and the countdown restarts


def test_a_scout_lets_the_probe_run_where_the_text_became_predictable_or_it_cannot_judge():
    s = _declined()
    _until_probe(s)
    assert s.scout([True] * 60, seconds=0.001)  # 61 hits in 64: ~3.9 tokens expected
    assert s.probing and s.num_scouts_stopped == 0
    s.observe(True, 5, 0.030, first_hit=True)  # the probe's speculative step wins: speculation resumes
    assert s.speculate() and not s.probing
    unsure = _declined()
    _until_probe(unsure)
    assert unsure.scout([False] * (SCOUT_MIN - 5), seconds=0.001)  # 7 guesses: no verdict, the probe runs
    assert unsure.probing


def test_cheap_scouts_probe_more_often_than_speculative_probes():
    """A probe's price is its scout's, plus a losing speculative step as often as scouts let one run, so
    the overhead budget allows more of them."""
    config = GuardConfig(probe_every=2, max_probe_every=8, probe_overhead=0.01, winning_probe_overhead=0.0,
                         min_spec_steps=1, scout=True)
    s = _declined(config)
    before = s.probe_interval()  # a losing speculative probe: 0.030 - 2.27 x 0.010 s, ~70 plain steps' 1%
    _until_probe(s)
    s.scout([False] * 10, seconds=0.001)
    rate = s.memory.scout_pass_rate
    assert rate == 0.375
    loss = 0.001 + rate * (s.spec_s.value - s.spec_tokens.value * s.plain_s.value)
    assert s.probe_interval() == math.ceil(loss / (0.01 * s.plain_s.value)) < before
    unscouted = _declined(GuardConfig(**{**config.__dict__, "scout": False}))
    assert unscouted.probe_interval() == before
    assert not Guard(config).start(greedy=True).scouts  # greedy requests never scout (GuardConfig.scout)
    assert not Guard().start(greedy=False).scouts  # opt-in


class _ScoutScript:
    """A guard state on a fixed script: "S" speculate, "P" plain, "Y" / "N" a probe whose scout lets it run
    or stops it. Records what the engine tells it."""

    scouts = True

    def __init__(self, script: str):
        self.script, self.i, self.probing = script, 0, False
        self.scout_calls: list[tuple[list[bool], float]] = []
        self.observed: list[tuple[bool, float, bool | None]] = []  # (speculated, seconds, first_hit)

    def speculate(self) -> bool:
        self.step = self.script[min(self.i, len(self.script) - 1)]
        self.i += 1
        self.probing = self.step in "YN"
        return self.step != "P"

    def scout(self, hits: list[bool], seconds: float) -> bool:
        self.scout_calls.append((hits, seconds))
        return self.step == "Y"

    def observe(self, speculated, committed_tokens, seconds, verified_tokens=0, first_hit=None, catch_up_s=0.0) -> None:
        self.observed.append((speculated, seconds, first_hit))


def test_scout_hits_are_the_drafters_guesses_at_the_skipped_steps_and_the_output_stays_exact():
    """Each hit compares the drafter's top guess after a committed prefix with the token the target committed
    next: the same guesses one causal drafter forward over the whole text gives. The scout is drafting work:
    the step's stats count it, the guard's step times leave it out; the text is plain decoding's."""
    llm = LLM("moespec-tiny", policy="evict", **forced_speculation())
    source = llm.engine.draft_source
    scout = source.scout
    source.scout = lambda state: time.sleep(0.2) or scout(state)
    script = "SPPPPPPNPPYSSSSSSSSSSSS"
    state = _ScoutScript(script)
    llm.engine.guard = type("Scripted", (), {"start": lambda self, greedy=True: state})()
    prompt = llm.encode(["def fib(n):\n"])[0]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    out = llm.generate([prompt], params)[0]
    assert out.token_ids == LLM("moespec-tiny", policy="ar").generate([prompt], params)[0].token_ids

    # the reference guesses: drafter position t pairs the target's hidden at t with token t+1, predicts t+2
    seq = prompt + out.token_ids
    target, drafter = llm.engine.target, source.drafter
    hidden = target.prefill(target.new_cache(), torch.tensor([seq[:-1]])).hidden
    guesses = drafter.extend(drafter.new_cache(), torch.tensor([seq[1:]]), hidden, top1=True).tolist()
    first = [len(prompt) + 1 + sum(s.committed_tokens for s in out.steps[:i]) for i in range(len(out.steps))]

    def hits(steps):  # the steps' committed tokens (one each: plain steps) against the drafter's guess
        return [guesses[first[i] - 2] == seq[first[i]] for i in steps]

    (hits_n, seconds_n), (hits_y, seconds_y) = state.scout_calls
    assert hits_n == hits(range(1, 7)) and hits_y == hits(range(7, 10))  # the stopped probe's step is skipped too
    assert any(hits_n + hits_y) and seconds_n >= 0.2 and seconds_y >= 0.2
    flags = [(s.speculated, s.scouted) for s in out.steps[:12]]
    assert flags == [(True, False)] + [(False, False)] * 6 + [(False, True)] + [(False, False)] * 2 + [(True, False)] * 2
    for i in (7, 10):  # the stopped probe's plain step and the passed probe's speculative step
        assert out.steps[i].step_ms >= 200 and out.steps[i].draft_ms >= 200  # the steps paid for the scout...
        assert state.observed[i][1] < 0.2  # ...the guard's view of them did not
    spec = [i for i, (speculated, _, _) in enumerate(state.observed) if speculated]
    assert [state.observed[i][2] for i in spec] == hits(spec)  # each speculative step's own first guess
