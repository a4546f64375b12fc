"""Per-batch-size costs and the goodput guard (plain arithmetic, no model)."""

from __future__ import annotations

import math

import pytest

from trtllm_moespec.core.cost import ExpertCostModel
from trtllm_moespec.core.cost import CostTable
from trtllm_moespec.engine.batch_cost import BatchCosts, BatchTableCosts, GoodputGuard


def test_batch_costs_measure_the_intercept_per_batch_size():
    costs = BatchCosts(ExpertCostModel(0.01, 0.001, 0.0001))
    assert costs.model(4).c0 == pytest.approx(0.04)  # unmeasured: no sharing assumed
    for seconds in (0.020, 0.022, 0.030):
        costs.record(4, num_nodes=10, unique_pairs=100, seconds=seconds)
    m = costs.model(4)
    assert m.c0 == pytest.approx(0.022 - 0.010 - 0.010) and (m.c_tok, m.c_exp) == (0.001, 0.0001)
    assert costs.model(2).c0 == pytest.approx(0.02)
    fixed = BatchCosts(ExpertCostModel(0.01, 0.001, 0.0001), measure=False)
    fixed.record(4, 10, 100, 1.0)
    assert fixed.model(4).c0 == pytest.approx(0.04)


def test_batch_table_costs_shift_the_profiled_table_by_a_measured_intercept():
    costs = BatchTableCosts(CostTable((0.010, 0.012, 0.016)))
    assert costs.table(1, 2).tolist() == pytest.approx([0.010, 0.012, 0.016])  # one request: the profile
    assert costs.table(4, 4).tolist() == pytest.approx([0.040, 0.042, 0.046, 0.049, 0.052])  # mean slope past K
    for seconds in (0.030, 0.031, 0.040):
        costs.record(4, num_nodes=3, unique_pairs=0, seconds=seconds)
    assert costs.table(4, 1).tolist() == pytest.approx([0.031 - 0.009, 0.031 - 0.009 + 0.002])


def test_guard_tries_both_then_follows_goodput_and_backs_off_its_probes():
    guard = GoodputGuard(alpha=1.0, probe_every=2, max_probe_every=8, min_spec_steps=1)
    assert guard.speculate(4) is True
    guard.record(4, True, tokens=4, seconds=1.0)  # speculation: 4 tokens/s
    assert guard.speculate(4) is False
    guard.record(4, False, tokens=4, seconds=0.5)  # plain: 8 tokens/s wins
    choices = []
    for _ in range(40):
        spec = guard.speculate(4)
        choices.append(spec)
        guard.record(4, spec, 4, 1.0 if spec else 0.5)
    probes = [i for i, c in enumerate(choices) if c]
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert probes and gaps == sorted(gaps) and gaps[-1] == 9  # intervals double up to the cap (8 plain steps)
    guard.record(4, True, tokens=40, seconds=1.0)  # speculation became better
    assert guard.speculate(4) is True
    assert guard.speculate(2) is True  # batch sizes are measured separately, smaller ones from scratch


def test_probes_of_a_much_dearer_mode_are_spaced_to_cost_at_most_the_overhead():
    guard = GoodputGuard(alpha=1.0, probe_every=16, max_probe_every=1024, probe_overhead=0.05, min_spec_steps=1)
    guard.record(8, True, 8, 1.0)  # a speculative step: 10x the time of a plain one, fewer tokens per second
    guard.record(8, False, 8, 0.1)
    steps = 0
    while not guard.speculate(8):
        guard.record(8, False, 8, 0.1)
        steps += 1
    assert steps == 180  # (1.0 / 0.1 - 1) / 0.05


def test_guard_starts_plain_at_a_larger_batch_where_speculation_lost_below():
    guard = GoodputGuard(alpha=1.0, probe_overhead=0.02, min_spec_steps=1)
    guard.record(2, True, 4, 1.0)
    guard.record(2, False, 4, 0.5)  # at B=2 plain wins
    assert guard.speculate(4) is False and guard.speculate(1) is False  # so neighbours start plain...
    steps = 0
    while not guard.speculate(4):  # ...and follow B=2 until the engine's one probe countdown runs out
        guard.record(4, False, 8, 0.5)
        steps += 1
    assert steps == 50  # (1.0 / 0.5 - 1) / 0.02 from B=2, not one probe per newly seen batch size
    guard.record(4, True, 8, 1.0)  # the probe measures speculation at B=4 itself: it loses there too
    assert guard.num_probes == 1 and guard.speculate(4) is False and guard._until_probe == 50


def test_batch_size_drift_does_not_cost_a_probe_per_size():
    """Under continuous batching the size moves every few steps; only the countdown probes."""
    guard = GoodputGuard(alpha=1.0, probe_every=16, max_probe_every=1024, probe_overhead=0.05, min_spec_steps=1)
    guard.record(8, True, 8, 0.5)
    guard.record(8, False, 8, 0.1)  # plain wins 5x: probes every (0.5 / 0.1 - 1) / 0.05 = 80 steps
    choices = []
    for step in range(200):
        b = 8 - step % 5  # 8, 7, 6, 5, 4, 8, ...
        spec = guard.speculate(b)
        choices.append(spec)
        guard.record(b, spec, b, 0.5 if spec else 0.1)
    assert sum(choices) == 2 and guard.num_probes == 2


def test_no_verdict_against_speculation_before_min_spec_steps():
    """One speculative step commits 1..D+1 tokens per request: an unlucky first one must not send the
    batch to plain decoding for a probe interval; the verdict waits for `min_spec_steps` of them."""
    guard = GoodputGuard(alpha=0.3, probe_overhead=0.01)  # min_spec_steps=4
    assert guard.speculate(4)
    guard.record(4, True, tokens=4, seconds=0.05)  # nothing accepted: 80 tokens/s
    assert not guard.speculate(4)
    guard.record(4, False, tokens=4, seconds=0.025)  # plain: 160 tokens/s wins on one step each
    for _ in range(3):  # speculation is measured until it has 4 steps
        assert guard.speculate(4)
        guard.record(4, True, tokens=16, seconds=0.05)  # 320 tokens/s
    assert guard.num_spec_steps == 4 and guard.num_probes == 0  # learning steps are no probes
    assert all(guard.speculate(4) for _ in range(3))  # and then it wins
    losing = GoodputGuard(alpha=0.3)
    losing.record(4, True, 4, 0.05)
    losing.record(4, False, 4, 0.025)
    for _ in range(3):
        losing.record(4, losing.speculate(4), 4, 0.05)
    assert not losing.speculate(4) and losing._until_probe == 100  # (0.05 / 0.025 - 1) / 0.01


def test_guard_rejects_bad_settings():
    with pytest.raises(ValueError):
        GoodputGuard(min_spec_steps=0)
    with pytest.raises(ValueError):
        GoodputGuard(alpha=0)
    with pytest.raises(ValueError):
        GoodputGuard(probe_every=64, max_probe_every=32)


def test_a_probe_that_beats_the_winner_is_not_backed_off():
    guard = GoodputGuard(alpha=0.1, probe_every=4, max_probe_every=64, probe_overhead=0.5, min_spec_steps=1)
    guard.record(2, True, 2, 1.0)
    guard.record(2, False, 4, 1.0)  # plain 4 tokens/s wins over 2
    for _ in range(3):  # losing probes: the interval doubles 4 -> 8 -> 16 -> 32
        while not guard.speculate(2):
            guard.record(2, False, 4, 1.0)
        guard.record(2, True, 2, 1.0)
    assert guard._interval == 32
    while not guard.speculate(2):
        guard.record(2, False, 4, 1.0)
    guard.record(2, True, 6, 1.0)  # 6 tokens/s beats plain's 4, but the slow average still says plain
    assert guard.speculate(2) is False and guard._interval == 4


def test_one_stalled_step_does_not_flip_the_batch_decision():
    guard = GoodputGuard(alpha=0.2, min_spec_steps=1)
    guard.record(4, True, 12, 0.062)  # 194 tok/s speculating
    guard.record(4, False, 4, 0.017)  # 235 tok/s plain
    guard.record(4, False, 4, 0.800)  # a stall (5 tok/s): counted as 3 plain steps' time at most (78 tok/s)
    assert guard.speculate(4) is False  # 0.8 * 235 + 0.2 * 78 = 204 tok/s (unclipped: 189): plain still wins


def test_a_slow_first_speculative_step_does_not_send_the_batch_to_plain_decoding():
    """The first steps carry one-time costs (numba caches, first allocations): the first `min_spec_steps`
    times of each mode set its estimate as their median, so one slow first step is not the mean."""
    guard = GoodputGuard(alpha=0.3, min_spec_steps=4)
    for seconds in (0.36, 0.033, 0.034, 0.031):  # warm-up, then 100 tokens/s at 3.3 tokens a step
        assert guard.speculate(1)
        guard.record(1, True, tokens=3, seconds=seconds)
        if guard.num_spec_steps == 1:
            assert not guard.speculate(1)  # plain decoding measured once
            guard.record(1, False, tokens=1, seconds=0.013)  # 77 tokens/s
    assert guard._seconds[(1, True)].value == pytest.approx((0.033 + 0.034) / 2)
    assert all(guard.speculate(1) for _ in range(3))  # speculation wins: no plain step, no probe
    naive = GoodputGuard(alpha=0.3, min_spec_steps=1)  # the first observation sets the mean: plain decoding
    for seconds in (0.36, 0.033, 0.034, 0.031):
        naive.record(1, True, 3, seconds)
    naive.record(1, False, 1, 0.013)
    assert not naive.speculate(1)


def _greedy_batch_losing(**kwargs) -> GoodputGuard:
    """A greedy batch of 2 where speculation (3 tokens a step at 3x a plain step's time) lost to plain decoding
    (2 tokens a step): the verdict is plain, every rule of greedy batches on."""
    guard = GoodputGuard(**{**dict(alpha=1.0, probe_every=4, max_probe_every=64, min_spec_steps=1), **kwargs})
    guard.record(2, True, tokens=3, seconds=0.03, greedy=True)  # 100 tokens/s
    guard.record(2, False, tokens=2, seconds=0.01, greedy=True)  # 200 tokens/s
    assert guard.speculate(2, greedy=True) is False
    return guard


def test_a_greedy_batch_holds_speculation_until_it_loses_by_more_than_the_hold():
    for greedy, kept in ((True, True), (False, False)):
        guard = GoodputGuard(alpha=1.0, min_spec_steps=1)  # hold 0.15
        guard.record(2, True, 6, 0.03, greedy=greedy)  # 200 tokens/s
        guard.record(2, False, 2, 0.01, greedy=greedy)  # 200 tokens/s: a tie goes to speculation
        assert guard.speculate(2, greedy=greedy)
        guard.record(2, True, 5.4, 0.03, greedy=greedy)  # 180 tokens/s: 10% behind plain decoding
        assert guard.speculate(2, greedy=greedy) is kept  # held only for a greedy batch
    plain = _greedy_batch_losing()  # a greedy batch decoding plainly resumes only where speculation wins
    plain.record(2, True, 5.4, 0.03, greedy=True)  # 180 tokens/s: within the hold, but behind plain's 200
    assert not plain.speculate(2, greedy=True)
    held = GoodputGuard(alpha=1.0, min_spec_steps=1)
    held.record(2, True, 6, 0.03, greedy=True)
    held.record(2, False, 2, 0.01, greedy=True)
    held.record(2, True, 4.8, 0.03, greedy=True)  # 160 tokens/s: 20% behind, past the hold
    assert not held.speculate(2, greedy=True)


def test_a_probe_is_priced_by_the_tokens_it_commits_and_greedy_probes_by_the_win_rate():
    """A losing probe's extra time is its seconds beyond what the winner needs for its tokens: 0.03 - 3 / 200 s.
    A greedy batch's budget for probing speculation is 10% x the probe win rate (0.5 at first) where that beats
    the fixed 1%; a sampled batch keeps the 1%."""
    sampled = _greedy_batch_losing(max_probe_every=1024)
    assert sampled._affordable_interval(2, greedy=False) == math.ceil(0.015 / (0.01 * 0.01))  # 150 plain steps
    guard = _greedy_batch_losing(max_probe_every=1024)
    assert guard._affordable_interval(2, greedy=True) == math.ceil(0.015 / (0.05 * 0.01))  # 30
    guard.probe_win_rate = 0.0  # probes that keep losing: back to the fixed budget
    assert guard._affordable_interval(2, greedy=True) == 150


def test_a_greedy_batch_scouts_and_speculates_where_the_guesses_say_it_pays():
    guard = _greedy_batch_losing(scout_every=8, probe_overhead=0.5, probe_every=32)
    assert not guard.wants_scout(2, greedy=False)  # sampled batches never scout
    plain = 0
    while not guard.wants_scout(2, greedy=True):
        guard.record(2, False, 2, 0.01, greedy=True)
        plain += 1
    assert plain == 7  # 8 plain steps since the speculative one: scout_every (the budget would allow 3)
    assert not guard.scout(2, [True] * 4, seconds=0.001, depth=4)  # 4 guesses: too few to judge
    assert guard.num_scouts == 1 and not guard.speculate(2, greedy=True)
    for _ in range(8):
        guard.record(2, False, 2, 0.01, greedy=True)
    # 20 hits of 24: h = 5/6, so sum(h^d, d = 0..4) = 3.59 tokens per request, 7.2 for the batch in 0.03 s:
    # 239 tokens/s beat plain's 200. The prediction becomes the estimate and the step speculates.
    assert guard.scout(2, [True] * 16 + [False] * 4, seconds=0.001, depth=4)
    assert guard.num_scout_probes == 1 and guard.speculate(2, greedy=True)
    guard.record(2, True, 2, 0.03, greedy=True)  # its step commits 2 tokens (67 tokens/s): the probe lost
    assert guard.probe_win_rate == 0.375 and guard._interval == 64 and not guard.speculate(2, greedy=True)


def test_a_scout_that_predicts_a_loss_keeps_the_batch_plain():
    guard = _greedy_batch_losing(scout_every=2, probe_overhead=0.5)
    for _ in range(2):
        guard.record(2, False, 2, 0.01, greedy=True)
    assert guard.wants_scout(2, greedy=True)
    assert not guard.scout(2, [True] * 8 + [False] * 8, seconds=0.001, depth=4)  # h = 1/2: 3.9 tokens, 130/s
    assert guard.num_scout_probes == 0 and guard._rate(2, True) == 100.0  # the estimate stands


def test_scouts_dearer_than_the_budget_allows_are_spaced_out():
    guard = _greedy_batch_losing(scout_every=2, probe_overhead=0.5, winning_probe_overhead=0.0)
    for _ in range(2):
        guard.record(2, False, 2, 0.01, greedy=True)
    guard.scout(2, [False] * 16, seconds=0.02, depth=4)  # a scout of two plain steps' time, at a 50% budget
    waited = 0
    while not guard.wants_scout(2, greedy=True):
        guard.record(2, False, 2, 0.01, greedy=True)
        waited += 1
    assert waited == 4  # 0.02 s within 50% of 4 plain steps' 0.01 s


def test_greedy_batch_guard_rejects_bad_settings():
    for bad in (dict(hold=1.0), dict(hold=-0.1), dict(winning_probe_overhead=1.5), dict(scout_every=-1)):
        with pytest.raises(ValueError):
            GoodputGuard(**bad)


def test_scouts_that_call_no_winning_probe_are_spaced_out_to_the_fixed_budget():
    """A scout's budget is 10% x the share of scouts that called a winning probe (even odds at first), at least
    the fixed 1%: where the guesses never say speculation pays, scouts of 0.1 plain steps come every 10 steps."""
    guard = _greedy_batch_losing(scout_every=2, probe_every=1024, max_probe_every=1024)
    gaps, plain = [], 0
    for _ in range(120):
        if guard.wants_scout(2, greedy=True):
            gaps.append(plain)
            plain = 0
            assert not guard.scout(2, [False] * 4, seconds=0.001, depth=4)
        guard.record(2, False, 2, 0.01, greedy=True)
        plain += 1
    # the first once a probe is affordable (30 plain steps), then 0.001 s within 10% x 0.375, 0.28, ... of theirs
    assert gaps[:9] == [29, 3, 4, 5, 7, 9, 10, 10, 10]


def test_a_sampled_prior_prices_speculation_from_the_first_plain_step_and_waits_for_the_budgeted_probe():
    """With a model's prior (1.3 tokens per speculative step, each 2.1 plain steps) a sampled batch decodes one
    plain step, finds speculation losing (1.3 / 2.1 of plain's goodput) and probes only once that probe's loss fits
    the budget: 2.1 x (1 - 1.3 / 2.1) = 0.8 plain steps within 1% of the plain time, 80 steps."""
    from trtllm_moespec.engine.guard import SampledPrior

    guard = GoodputGuard(alpha=0.3, probe_overhead=0.01, prior=SampledPrior(1.3, 2.1))
    choices = []
    for _ in range(90):
        spec = guard.speculate(4)
        choices.append(spec)
        guard.record(4, spec, 4 if not spec else 6, 0.1 if not spec else 0.21)
    assert choices.index(True) == 81 and choices.count(True) == 1  # the first plain step, then 80 steps
    unprimed = GoodputGuard(alpha=0.3, probe_overhead=0.01)
    assert unprimed.speculate(4)  # no prior: learn by speculating


def test_greedy_and_sampled_batches_keep_apart_estimates_and_only_sampled_ones_start_from_the_prior():
    from trtllm_moespec.core.sampling import SamplingConfig
    from trtllm_moespec.engine.batch_cost import GuardsByKind
    from trtllm_moespec.engine.guard import SampledPrior

    from trtllm_moespec.engine.engine import Request

    def request(sampling):
        return Request(prompt_ids=[1], sampling=sampling, max_tokens=4, generator=None)

    guards = GuardsByKind(SampledPrior(1.3, 2.1))
    t1, t0 = request(SamplingConfig(temperature=1.0)), request(SamplingConfig())
    sampled, greedy = guards.of(False, [t1, t1]), guards.of(True, [t0, t0])
    assert sampled is not greedy and guards.of(False, [t1]) is sampled
    assert sampled.prior is not None and greedy.prior is None
    for _ in range(6):  # sampled batches measure speculation losing...
        sampled.record(2, True, tokens=2, seconds=1.0)
        sampled.record(2, False, tokens=2, seconds=0.1)
    assert sampled.speculate(2) is False
    assert greedy.speculate(2) is True  # ...which greedy batches never see: they measure their own
    assert GuardsByKind(SampledPrior(1.3, 2.1)).of(False, [t1, request(SamplingConfig(1.0, top_p=0.9))]).prior is None
