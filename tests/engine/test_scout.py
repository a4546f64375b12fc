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
    scout_top = 1

    def __init__(self, script: str):
        self.script, self.i, self.probing = script, 0, False
        self.scout_calls: list[tuple[list[bool], float]] = []
        self.observed: list[tuple[bool, float, bool | None]] = []  # (speculated, seconds, first_hit)

    def speculate(self) -> bool:
        self.step = self.script[min(self.i, len(self.script) - 1)]
        self.i += 1
        self.probing = self.step in "YN"
        return self.step != "P"

    def wants_scout(self, speculate: bool) -> bool:
        return speculate and self.probing

    def scout(self, hits: list[bool], seconds: float, depth: int = 0) -> bool:
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
    source.scout = lambda state, top=1: time.sleep(0.2) or scout(state, top)
    script = "SPPPPPPNPPYSSSSSSSSSSSS"
    state = _ScoutScript(script)
    llm.engine.guard = type("Scripted", (), {"start": lambda self, *args, **kwargs: state})()
    prompt = llm.encode(["def fib(n):\n"])[0]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    out = llm.generate([prompt], params)[0]
    assert out.token_ids == LLM("moespec-tiny", policy="ar").generate([prompt], params)[0].token_ids

    # the reference guesses: drafter position t pairs the target's hidden at t with token t+1, predicts t+2
    seq = prompt + out.token_ids
    target, drafter = llm.engine.target, source.drafter
    hidden = target.prefill(target.new_cache(), torch.tensor([seq[:-1]])).hidden
    guesses = drafter.extend(drafter.new_cache(), torch.tensor([seq[1:]]), hidden, top=1)[:, 0].tolist()
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


def _greedy_declined(config: GuardConfig = GuardConfig(probe_every=64, max_probe_every=64, min_spec_steps=1,
                                                        scout_every=4, winning_probe_overhead=0.0,
                                                        probe_overhead=1.0)):
    """A greedy request whose speculative steps committed ~1.4 tokens at 3 plain steps' cost: speculation
    loses, so it decodes plainly; its blind probe is 64 plain steps away."""
    s = Guard(config).start(greedy=True)
    for tokens in (2, 1, 1, 1):
        s.observe(True, tokens, 0.030)
    assert not s.speculate()
    s.observe(False, 1, 0.010)
    return s


def _plain_until_scout(s) -> int:
    for steps in range(200):
        if s.wants_scout(s.speculate()):
            return steps
        assert not s.probing  # no blind probe comes first
        s.observe(False, 1, 0.010)
    raise AssertionError("no scout in 200 plain steps")


def test_a_greedy_scout_calls_a_probe_where_the_plain_steps_became_predictable():
    s = _greedy_declined()
    assert s.scout_top == 2 and not s.scouts  # greedy: no probe-gating scout, but periodic ones
    assert _plain_until_scout(s) == 3  # every scout_every (4) plain steps
    assert not s.scout([True, False, True, False], seconds=0.001, depth=6)  # 4 guesses: too few to judge
    _plain_until_scout(s)
    before = s.spec_tokens.value
    assert not s.scout([True, True, False, True], seconds=0.001, depth=6)  # 5 hits in 8: ~2.6 tokens, 3 needed
    assert not s.probing and s.num_scout_probes == 0
    assert s.spec_tokens.value == before  # a scout that calls no probe leaves the estimate alone
    _plain_until_scout(s)
    assert s.scout([True] * 8, seconds=0.001, depth=6)  # 13 hits in 16: ~4.1 tokens
    h = 13 / 16
    expected = sum(h ** d for d in range(7))
    assert expected > 4 and s.probing and s.num_scout_probes == 1
    assert s.spec_tokens.value == expected  # the scout's reading replaces the estimate of the steps before
    s.observe(True, 4, 0.030)  # the probe wins: speculation resumes
    assert s.speculate() and not s.probing and len(s.plain_hits) == 0  # a later scout judges fresh plain steps


def test_a_greedy_probe_a_scout_called_that_loses_doubles_the_interval_and_scouts_wait_for_the_budget():
    config = GuardConfig(probe_every=64, max_probe_every=128, min_spec_steps=1, scout_every=2,
                         winning_probe_overhead=0.0, probe_overhead=0.05)
    s = _greedy_declined(config)
    waited = _plain_until_scout(s)
    assert waited + 1 >= s.budget_steps() > config.scout_every  # the probe budget binds the scouts too
    assert s.scout([True] * 8, seconds=0.001, depth=4)  # 5 tokens expected
    s.observe(True, 1, 0.030)  # the probe's step commits one token: judged lost (3 needed) ...
    assert s.probe_every == 128 and s.memory.probe_win_rate < 0.5
    assert s.speculate()  # ... but one step does not outweigh the scout's 8 positions
    for _ in range(3):
        s.observe(True, 1, 0.030)
    assert not s.speculate()  # four do (with the hold, GuardConfig.hold)
    off = _greedy_declined(GuardConfig(**{**config.__dict__, "scout_every": 0}))
    for _ in range(63):  # no scout before the blind probe
        assert not off.wants_scout(off.speculate())
        off.observe(False, 1, 0.010)
    assert off.speculate() and off.probing


def test_greedy_scouts_that_cost_more_than_the_budget_allows_are_spaced_out():
    """A scout is a drafter forward: where it costs a fifth of a plain step (moespec-tiny) and probes keep
    losing, scouting every 8 plain steps would cost 2.5% of the time; the interval keeps it within budget."""
    config = GuardConfig(probe_every=64, max_probe_every=64, min_spec_steps=1, scout_every=8,
                         winning_probe_overhead=0.0, probe_overhead=0.005)
    s = _greedy_declined(config)
    assert s.scout_interval() == 8  # no scout measured yet
    s.scout([], seconds=0.002, depth=6)  # a fifth of the 10 ms plain step
    assert s.scout_interval() == math.ceil(0.002 / (0.005 * 0.010)) == 40
    cheap = _greedy_declined(GuardConfig(**{**config.__dict__, "probe_overhead": 0.1}))
    cheap.scout([], seconds=0.002, depth=6)
    assert cheap.scout_interval() == 8


def test_scout_every_is_validated():
    import pytest

    with pytest.raises(ValueError, match="scout_every"):
        GuardConfig(scout_every=-1)


def test_greedy_scout_hits_are_the_committed_tokens_rank_among_the_drafters_top_guesses_and_the_output_stays_exact():
    """A greedy request's plain steps with a scout ("G": it calls no probe, "H": it does): each hit says whether
    the committed token was among the drafter's top 2 guesses after the committed prefix, as one causal drafter
    forward over the whole text gives them; the text is plain decoding's."""
    llm = LLM("moespec-tiny", policy="evict", **forced_speculation())
    source = llm.engine.draft_source
    calls = []
    scout = source.scout
    source.scout = lambda state, top=1: calls.append(top) or scout(state, top)

    class Greedy(_ScoutScript):
        scout_top = 2

        def speculate(self) -> bool:
            self.step = self.script[min(self.i, len(self.script) - 1)]
            self.i += 1
            return self.step == "S"

        def wants_scout(self, speculate: bool) -> bool:
            return self.step in "GH"

        def scout(self, hits, seconds, depth=0):
            self.scout_calls.append((hits, depth))
            return self.step == "H"

    state = Greedy("SPPPGPPPPHSSSSSSSSSSSS")
    llm.engine.guard = type("Scripted", (), {"start": lambda self, *args, **kwargs: state})()
    prompt = llm.encode(["def fib(n):\n"])[0]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    out = llm.generate([prompt], params)[0]
    assert out.token_ids == LLM("moespec-tiny", policy="ar").generate([prompt], params)[0].token_ids
    assert calls == [2, 2]

    seq = prompt + out.token_ids
    target, drafter = llm.engine.target, source.drafter
    hidden = target.prefill(target.new_cache(), torch.tensor([seq[:-1]])).hidden
    top2 = drafter.extend(drafter.new_cache(), torch.tensor([seq[1:]]), hidden, top=2).tolist()
    first = [len(prompt) + 1 + sum(s.committed_tokens for s in out.steps[:i]) for i in range(len(out.steps))]

    def hits(steps):
        return [seq[first[i]] in top2[first[i] - 2] for i in steps]

    (hits_g, depth_g), (hits_h, depth_h) = state.scout_calls
    assert hits_g == hits(range(1, 4)) and hits_h == hits(range(4, 9))  # the plain steps since the last catch-up
    assert depth_g == depth_h == source.steps
    assert [s.speculated for s in out.steps[:11]] == [True] + [False] * 8 + [True] * 2  # "H" speculates at once
    assert [s.scouted for s in out.steps[:11]] == [False] * 4 + [True] + [False] * 6


def test_a_greedy_batch_scouts_every_request_and_speculates_where_its_scout_says_so():
    """The batched engine's greedy scouts (engine/batch_cost.py `GoodputGuard.scout`) on a scripted guard: "G" a
    plain step whose scout calls no probe, "H" one whose scout does. Each request's hits say whether its committed
    tokens were among its drafter's top 2 guesses after the committed prefix (one causal drafter forward over its
    text); the step "H" calls speculates at once, and every request's text is plain decoding's."""
    from trtllm_moespec.engine.batch import BatchedEngine
    from trtllm_moespec.engine.batch_cost import GoodputGuard

    class Scripted(GoodputGuard):
        def __init__(self, script: str):
            super().__init__()
            self.script, self.i, self.scout_calls = script, 0, []

        def speculate(self, batch_size: int, greedy: bool = False) -> bool:
            self.step = self.script[min(self.i, len(self.script) - 1)]
            self.i += 1
            return self.step == "S"

        def wants_scout(self, batch_size: int, greedy: bool) -> bool:
            return greedy and self.step in "GH"

        def scout(self, batch_size, hits, seconds, depth):
            self.scout_calls.append((batch_size, hits, depth))
            return self.step == "H"

    llm = LLM("moespec-tiny", policy="evict", **forced_speculation())
    prompts = llm.encode(["def fib(n):\n", "The capital of France"])
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    guard = Scripted("SPPPGPPPPHSSSSSSSSSSSSSSSSSSSSSS")
    engine = BatchedEngine(llm.engine, max_batch_size=2, batch_policy="evict-batch", goodput_guard=guard)
    requests = [llm.make_request(p, params) for p in prompts]
    engine.run_all(requests)
    ar = LLM("moespec-tiny", policy="ar").generate(prompts, params)
    assert [r.output_ids for r in requests] == [out.token_ids for out in ar]

    target, drafter = llm.engine.target, llm.engine.draft_source.drafter
    expected = {"G": [], "H": []}
    for prompt, request in zip(prompts, requests):
        seq = prompt + request.output_ids
        hidden = target.prefill(target.new_cache(), torch.tensor([seq[:-1]])).hidden
        top2 = drafter.extend(drafter.new_cache(), torch.tensor([seq[1:]]), hidden, top=2).tolist()
        steps = request.steps  # the steps after the prefill's first token
        first = [len(prompt) + 1 + sum(s.committed_tokens for s in steps[:i]) for i in range(len(steps))]
        expected["G"] += [seq[first[i]] in top2[first[i] - 2] for i in range(1, 4)]
        expected["H"] += [seq[first[i]] in top2[first[i] - 2] for i in range(4, 9)]
        assert [s.verified_tokens > 0 for s in steps[:11]] == [True] + [False] * 8 + [True] * 2
        assert [s.speculated for s in steps[:11]] == [True] + [False] * 8 + [True] * 2
        assert [s.scouted for s in steps[:11]] == [False] * 4 + [True] + [False] * 6  # "G" stayed plain
    (b_g, hits_g, depth_g), (b_h, hits_h, depth_h) = guard.scout_calls
    assert (b_g, b_h) == (2, 2) and depth_g == depth_h == llm.engine.draft_source.steps
    assert hits_g == expected["G"] and hits_h == expected["H"]  # request by request, in admission order
