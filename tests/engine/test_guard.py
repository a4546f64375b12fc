"""The speculate-or-not rule (engine/guard.py) and the drafting stop rule inside the engine:
decisions on synthetic timings, and losslessness when steps switch between plain and speculative."""

from __future__ import annotations

import time

import pytest
import torch
import transformers

from tests.engine.conftest import TINY_TARGET, forced_speculation
from tests.engine.distribution import assert_follows, draw, exact_first_tokens
from trtllm_moespec import LLM, SamplingParams, TreeConfig
from trtllm_moespec.core import CostTable, ExpertCostModel
from trtllm_moespec.engine.guard import Guard, GuardConfig

PROMPT = [5, 17, 33, 2, 9, 100, 4]


def _feed(state, speculated, tokens, seconds):
    state.observe(speculated, tokens, seconds)


def test_guard_falls_back_while_speculation_loses_and_probes():
    # probe_overhead=1: a probe may cost as much as the plain steps between probes (only the doubling counts)
    guard = Guard(GuardConfig(probe_every=2, max_probe_every=8, probe_overhead=1.0, min_spec_steps=1))
    s = guard.start()
    assert s.speculate()  # nothing measured: try speculation
    _feed(s, True, 2, 0.040)  # 50 tok/s
    assert not s.speculate()  # plain cost unknown: measure one plain step
    _feed(s, False, 1, 0.010)  # 100 tok/s
    decisions = []
    for _ in range(12):
        d = s.speculate()
        decisions.append(d)
        _feed(s, d, 2 if d else 1, 0.040 if d else 0.010)  # probes keep losing
    # plain, plain, probe (interval 2 -> 4), 4 plain, probe (-> 8), ...
    assert decisions[:8] == [False, True, False, False, False, False, True, False]
    assert s.probe_every == 8 and s.num_probes == 2
    # The next request starts from what this one measured: plain at once, probes at the learned interval.
    s2 = guard.start()
    assert not s2.speculate() and s2.probe_every == 8
    s3 = guard.start(greedy=False)  # sampling accepts differently: its own memory, so it measures afresh
    assert s3.speculate() and s3.probe_every == 2


def test_guard_reenables_when_text_becomes_predictable():
    s = Guard(GuardConfig(probe_every=2, probe_overhead=1.0, min_spec_steps=1)).start()
    _feed(s, True, 2, 0.030)  # 67 tok/s: a probe costs one plain step more than its tokens
    _feed(s, False, 1, 0.010)
    assert not s.speculate()
    _feed(s, False, 1, 0.010)
    assert s.speculate() and s.probing  # probe
    _feed(s, True, 9, 0.040)  # the text became predictable: 225 tok/s
    assert s.speculate() and not s.probing  # speculation pays again: no longer a probe
    assert s.probe_every == 2


def test_probes_cost_at_most_probe_overhead_of_the_plain_time_and_count_down_over_requests():
    guard = Guard(GuardConfig(probe_every=2, max_probe_every=8, probe_overhead=0.02, winning_probe_overhead=0.0,
                              min_spec_steps=1))
    s = guard.start()
    _feed(s, True, 3, 0.050)  # a speculative step costs 5 plain steps and commits 3 tokens: 2 steps lost
    _feed(s, False, 1, 0.010)
    assert s.probe_interval() == 100  # 2 plain steps of loss are 2% of 100 plain steps
    decisions = []
    for i in range(150):
        if i == 60:  # a new request continues the engine's countdown instead of restarting it
            s = guard.start()
        d = s.speculate()
        decisions.append(d)
        _feed(s, d, 3 if d else 1, 0.050 if d else 0.010)
    assert decisions.index(True) == 99  # the 100th plain step since the last speculative one
    assert sum(decisions) == 1  # the losing probe doubled the interval, but the 2% bound still rules
    # A cheap probe (nearly paying) is tried at the doubling interval instead.
    cheap = Guard(GuardConfig(probe_every=2, max_probe_every=8, probe_overhead=0.02, min_spec_steps=1)).start()
    _feed(cheap, True, 3, 0.0302)
    _feed(cheap, False, 1, 0.010)
    assert cheap.probe_interval() == 2
    with pytest.raises(ValueError, match="probe_overhead"):
        GuardConfig(probe_overhead=0.0)


def test_the_probe_budget_relaxes_while_probes_win_and_tightens_while_they_lose():
    guard = Guard(GuardConfig(probe_every=2, max_probe_every=8, probe_overhead=0.01, winning_probe_overhead=0.1,
                              min_spec_steps=1))
    s = guard.start()
    _feed(s, True, 3, 0.050)  # 2 plain steps of loss per losing probe
    _feed(s, False, 1, 0.010)
    assert s.probe_interval() == 40  # even odds at first: a 5% budget
    for _ in range(12):  # probes that keep losing pull the win rate, and the budget, down to the 1% floor
        while not s.speculate():
            _feed(s, False, 1, 0.010)
        _feed(s, True, 3, 0.050)
    assert guard.memories[True].probe_win_rate < 0.1 and s.probe_interval() == 200
    s.probing = True
    _feed(s, True, 9, 0.050)  # a winning probe (180 tok/s): the win rate rises again
    assert guard.memories[True].probe_win_rate > 0.25
    with pytest.raises(ValueError, match="winning_probe_overhead"):
        GuardConfig(winning_probe_overhead=1.5)


def test_at_t_above_0_the_probe_budget_does_not_relax():
    """A sampled probe's win is mostly one lucky draw (a step commits 1..D+1 tokens at random), so at T > 0
    probes get the fixed `probe_overhead` budget, not the greedy one that relaxes with the win rate."""
    guard = Guard(GuardConfig(probe_every=2, max_probe_every=8, probe_overhead=0.01, winning_probe_overhead=0.1,
                              min_spec_steps=1))
    for greedy, interval in ((True, 40), (False, 200)):  # 2 plain steps of loss: a 5% (even odds) or 1% budget
        s = guard.start(greedy)
        _feed(s, True, 3, 0.050)
        _feed(s, False, 1, 0.010)
        assert s.probe_interval() == interval


def test_a_sampled_probe_is_priced_with_the_drafter_catch_up_before_it():
    """The catch-up before a speculative step is kept out of its time, but a probe pays it: at T > 0 the budget
    prices it in, so probes are spaced by all they cost; greedy requests (and `price_catch_up=False`) do not."""
    for price, greedy, interval in ((True, False, 400), (True, True, 40), (False, False, 200)):
        guard = Guard(GuardConfig(probe_every=2, max_probe_every=8, probe_overhead=0.01, winning_probe_overhead=0.1,
                                  min_spec_steps=1, price_catch_up=price))
        s = guard.start(greedy)
        s.observe(True, 3, 0.050, catch_up_s=0.020)  # 2 plain steps of loss, after a catch-up worth 2 more
        _feed(s, False, 1, 0.010)
        assert s.probe_interval() == interval, (price, greedy)  # 4 steps' loss at a 1% budget; greedy: 2 at 5%


def test_one_unlucky_speculative_step_is_no_verdict():
    """The guard decides only after the engine has measured `min_spec_steps` speculative steps (over
    requests): one step that commits a single token in warm-up time must not send speculation away for
    hundreds of plain steps (on moespec-base it did, for joint: 0.2 nodes verified per step instead of 6.7)."""
    guard = Guard(GuardConfig(min_spec_steps=4))
    s = guard.start()
    assert s.speculate()
    _feed(s, True, 1, 0.110)  # the first step: nothing accepted, warm-up time (plain: 35 ms)
    assert not s.speculate()  # one plain step, to know its cost
    _feed(s, False, 1, 0.035)
    assert s.pays() is None and s.speculate()  # a single speculative step decides nothing
    _feed(s, True, 5, 0.100)
    s = guard.start()  # the count is the engine's, across requests
    assert s.speculate()
    _feed(s, True, 5, 0.100)
    assert s.pays() is None and s.speculate()
    _feed(s, True, 5, 0.100)  # the fourth: now the estimates decide (about 3.9 tokens per 103 ms: it pays)
    assert s.pays() and s.speculate()
    losing = Guard(GuardConfig(min_spec_steps=2)).start()
    for _ in range(2):
        _feed(losing, True, 1, 0.110)
    _feed(losing, False, 1, 0.035)
    assert losing.pays() is False and not losing.speculate()
    with pytest.raises(ValueError, match="min_spec_steps"):
        GuardConfig(min_spec_steps=0)


def test_a_new_request_starts_from_the_engines_recent_mean_not_from_how_the_last_request_ended():
    """A request that ended on text the drafter cannot predict (its estimate at 1 token a step) must not send
    the next greedy one to plain decoding: each starts from the engine's mean over its latest `prior_window`
    speculative steps (on moespec-base the old rule kept new requests plain for ~50 steps that then
    committed 7 tokens a step). prior_window=0 is that old rule."""
    def third_request(prior_window: int, greedy: bool = True):
        guard = Guard(GuardConfig(probe_every=2, max_probe_every=8, probe_overhead=1.0, min_spec_steps=1, hold=0.0,
                                  prior_window=prior_window))
        easy = guard.start(greedy)
        assert easy.speculate()
        _feed(easy, True, 5, 0.020)  # 250 tok/s against plain's 100
        assert not easy.speculate()  # one plain step, to know its cost
        _feed(easy, False, 1, 0.010)
        for _ in range(20):
            assert easy.speculate()
            _feed(easy, True, 5, 0.020)
        hard = guard.start(greedy)
        decisions = []
        for _ in range(30):  # every speculative step commits 1 token: 50 tok/s
            decisions.append(hard.speculate())
            _feed(hard, decisions[-1], 1, 0.020 if decisions[-1] else 0.010)
        assert decisions[0] and not all(decisions) and hard.pays() is False  # it learned that its text loses
        return guard.start(greedy)
    new = third_request(32)  # the engine's mean over its last 32 speculative steps: ~3.7 tokens
    assert new.spec_tokens.value > 3 and new.pays() and new.speculate()
    old = third_request(0)  # the last request's tail: plain from the start (but for a probe the countdown may owe)
    assert old.spec_tokens.value < 2 and old.pays() is False
    # Sampled requests keep the old rule: the latest, losing probes' estimate keeps their probes rare.
    sampled = third_request(32, greedy=False)
    assert sampled.spec_tokens.value == old.spec_tokens.value and sampled.pays() is False
    with pytest.raises(ValueError, match="prior_window"):
        GuardConfig(prior_window=-1)


def test_hold_keeps_a_speculating_request_speculating_through_a_short_loss():
    """Hysteresis: speculating goes on until it loses by more than `hold`; once declined, it resumes only
    where it wins (margin), so the two thresholds differ and an estimate between them changes nothing."""
    def run(hold, greedy=True):
        s = Guard(GuardConfig(min_spec_steps=1, hold=hold, probe_every=4, probe_overhead=1.0)).start(greedy)
        assert s.speculate()
        _feed(s, True, 3, 0.030)  # 100 tok/s against plain's 1 / 0.012 = 83: pays
        assert not s.speculate()  # one plain step, to know its cost
        _feed(s, False, 1, 0.012)
        assert s.speculate()
        _feed(s, True, 2, 0.030)  # an unlucky step: the estimate drops to 2.75 / 30 ms = 92 tok/s, still pays
        assert s.speculate()
        _feed(s, True, 1, 0.030)  # another: 2.31 / 30 ms = 77 tok/s, 7.5% below plain
        return s
    held, strict, sampled = run(0.1), run(0.0), run(0.1, greedy=False)
    assert held.speculate() and not held.declined  # within the 10% hold: speculation goes on
    assert not strict.speculate() and strict.declined  # no hold: plain decoding until a probe
    # At T > 0 a step's tokens are mostly the luck of the draw: sampled requests keep the strict rule.
    assert not sampled.speculate() and sampled.declined
    # Declined, the hold no longer applies: the same 77 tok/s estimate keeps the request plain.
    for _ in range(3):
        _feed(strict, False, 1, 0.012)
        assert not strict.speculate()
    with pytest.raises(ValueError, match="hold"):
        GuardConfig(hold=1.0)


def test_one_stalled_plain_step_does_not_make_speculation_look_paying():
    s = Guard(GuardConfig(min_spec_steps=1)).start()
    _feed(s, True, 3, 0.025)  # 120 tok/s speculating
    _feed(s, False, 1, 0.0043)  # 233 tok/s plain
    _feed(s, False, 1, 0.200)  # one stall (47x): counted as 3x the plain mean at most
    assert s.plain_s.value == pytest.approx(0.75 * 0.0043 + 0.25 * 3 * 0.0043)
    assert not s.pays() and not s.speculate()
    for _ in range(6):  # a real slowdown still gets through within a few steps
        _feed(s, False, 1, 0.040)
    assert s.plain_s.value > 0.030 and s.pays()


def test_the_first_steps_set_the_time_estimates_as_their_median():
    """One-time costs of an engine's first steps (numba caches, first allocations: 359 ms against ~33 ms on
    moespec-base) must not price speculation for hundreds of steps: the first `min_spec_steps` step times
    of each kind set the estimate as their median, the EWMA goes on from there."""
    guard = Guard(GuardConfig(min_spec_steps=4))
    s = guard.start()
    _feed(s, True, 3, 0.36)  # warm-up
    _feed(s, False, 1, 0.013)  # 77 tok/s plain
    s2 = guard.start()  # a request that starts while the engine's estimates are still warming up
    for state in (s, s2):
        for seconds in (0.033, 0.034, 0.031):  # 3 tokens in ~33 ms: 91 tok/s
            _feed(state, True, 3, seconds)
    assert s.spec_s.value == pytest.approx(0.0335) and s.pays() and s.speculate()
    assert s2.spec_s.value == pytest.approx(0.0335) and s2.pays()  # it started from the warm-up observations
    _feed(s, True, 3, 0.040)  # past the warm-up: the EWMA
    assert s.spec_s.value == pytest.approx(0.75 * 0.0335 + 0.25 * 0.040)
    naive = Guard(GuardConfig(min_spec_steps=1)).start()  # the first observation sets the mean: plain decoding
    _feed(naive, True, 3, 0.36)
    _feed(naive, False, 1, 0.013)
    for seconds in (0.033, 0.034, 0.031):
        _feed(naive, True, 3, seconds)
    assert not naive.pays()


def test_measured_guard_measures_plain_steps_itself_and_refreshes_them():
    # The profile claims a 500 ms plain step; the measured guard does not trust it and measures one.
    s = Guard(GuardConfig(refresh_every=3), cost_table=(0.03,) * 9, plain_step_s=0.5).start()
    assert s.speculate()
    _feed(s, True, 3, 0.030)
    assert not s.speculate()  # plain cost unknown to the guard: measure it
    _feed(s, False, 1, 0.020)  # 50 tok/s plain vs 100 tok/s speculative
    decisions = []
    for _ in range(8):
        d = s.speculate()
        decisions.append(d)
        _feed(s, d, 3 if d else 1, 0.030 if d else 0.020)
    assert decisions == [True, True, True, False, True, True, True, False]  # a plain re-measure every 3 spec steps


def test_profiled_rule_uses_the_cost_table_not_wall_time():
    table = tuple(0.030 + 0.001 * k for k in range(9))
    guard = Guard(GuardConfig(measured=False), cost_table=table, plain_step_s=0.010)
    s = guard.start()
    assert s.speculate()
    s.observe(True, 4, seconds=99.0, verified_tokens=4)  # wall time ignored: C(4) = 34 ms, 4 tokens = 118/s
    assert s.speculate()
    s.observe(True, 1, seconds=0.0001, verified_tokens=8)
    s.observe(True, 1, seconds=0.0001, verified_tokens=8)
    s.observe(True, 1, seconds=0.0001, verified_tokens=8)
    assert not s.speculate()  # ~2 tokens per 37 ms < 100 tok/s plain
    with pytest.raises(ValueError, match="plain-step"):
        Guard(GuardConfig(measured=False), cost_table=table)
    with pytest.raises(ValueError, match="probe_every"):
        GuardConfig(probe_every=0)


class ScriptedGuard:
    """Speculate on a fixed pattern (cycled): exercises plain <-> speculative switches deterministically."""

    def __init__(self, pattern):
        self.pattern = pattern

    def start(self, greedy=True, sampling=None, constrained=False):
        return _Scripted(self.pattern)


class _Scripted:
    scouts = False  # no first guesses to record

    def wants_scout(self, speculate: bool) -> bool:
        return False  # never a scout

    def __init__(self, pattern):
        self.pattern, self.i = pattern, 0
        self.observed: list[tuple[bool, float]] = []  # (speculated, seconds) the guard was told

    def speculate(self) -> bool:
        d = self.pattern[self.i % len(self.pattern)]
        self.i += 1
        return d

    def observe(self, speculated, committed_tokens, seconds, verified_tokens=0, first_hit=None, catch_up_s=0.0) -> None:
        self.observed.append((speculated, seconds))


PATTERN = [False, False, True, False, True, True, False, False, False, True]


@pytest.fixture(scope="module")
def reference(checkpoints):
    out = {}
    for arch, (target, _) in checkpoints.items():
        kw = {"attn_implementation": "eager"} if arch == "gpt_oss" else {}
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(target), **kw)
        ids = hf.generate(torch.tensor([PROMPT]), max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0)
        out[arch] = ids[0, len(PROMPT):].tolist()
    return out


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
@pytest.mark.parametrize("policy", ["evict", "joint"])
def test_switching_plain_and_speculative_steps_is_exact(checkpoints, reference, arch, policy):
    target, draft = checkpoints[arch]
    predictor = "oracle" if policy == "joint" else None
    llm = LLM(str(target), draft_model=str(draft), policy=policy, predictor=predictor)
    llm.engine.guard = ScriptedGuard(PATTERN)
    out = llm.generate([PROMPT], SamplingParams(max_tokens=20, ignore_eos=True))[0]
    assert out.token_ids == reference[arch]
    flags = [s.speculated for s in out.steps]
    assert flags[: len(PATTERN)] == PATTERN[: len(flags)]
    assert all(s.verified_tokens == 0 for s in out.steps if not s.speculated)


def test_deferred_drafter_catch_up_equals_step_by_step(checkpoints):
    """After plain steps the drafter extends by all skipped tokens in one forward: its proposal for
    the next root equals that of a drafter fed every token one step at a time."""
    target, draft = checkpoints["qwen3_moe"]
    llm = LLM(str(target), draft_model=str(draft), policy="evict", guard="off")
    source = llm.engine.draft_source
    seen = {}
    original = source.drafter.draft_tree

    def spy(cache, *a, **kw):
        seen.setdefault(cache.num_tokens, cache.last_logits.clone())
        return original(cache, *a, **kw)

    source.drafter.draft_tree = spy
    llm.engine.guard = ScriptedGuard([True] * 3 + [False] * 4 + [True] * 20)
    deferred = llm.generate([PROMPT], SamplingParams(max_tokens=16, ignore_eos=True))[0]
    deferred_seen = dict(seen)
    seen.clear()
    llm.engine.guard = None
    plain = llm.generate([PROMPT], SamplingParams(max_tokens=16, ignore_eos=True))[0]
    assert deferred.token_ids == plain.token_ids
    common = sorted(set(seen) & set(deferred_seen))
    assert len(common) >= 3
    for n in common:
        torch.testing.assert_close(deferred_seen[n], seen[n], rtol=1e-4, atol=1e-5)


def test_the_drafter_catch_up_after_plain_steps_is_kept_out_of_the_guards_step_time(checkpoints, reference):
    """The catch-up forward over skipped tokens is the price of switching to speculation, paid once; a
    probe is judged on what speculating costs from then on, or every probe after a long plain run
    would look dearer than speculation is. The step's own stats still count it."""
    target, draft = checkpoints["qwen3_moe"]
    llm = LLM(str(target), draft_model=str(draft), policy="eagle3")  # every drafted node verified
    source = llm.engine.draft_source
    catch_up = source.catch_up

    def slow_catch_up(states):
        if any(s.pending_ids for s in states):
            time.sleep(0.2)
        catch_up(states)

    source.catch_up = slow_catch_up
    state = _Scripted([True, False, False, False, True, True])
    llm.engine.guard = ScriptedGuard(None)
    llm.engine.guard.start = lambda greedy=True, sampling=None, constrained=False: state
    out = llm.generate([PROMPT], SamplingParams(max_tokens=20, ignore_eos=True))[0]
    assert out.token_ids == reference["qwen3_moe"]
    switched = [i for i, s in enumerate(out.steps) if s.speculated and i > 0 and not out.steps[i - 1].speculated]
    assert switched and all(out.steps[i].verified_tokens > 0 for i in switched)
    for i in switched:
        assert out.steps[i].step_ms >= 200 and out.steps[i].draft_ms >= 200  # the step paid for it...
        assert state.observed[i][0] and state.observed[i][1] < 0.2  # ...the guard did not see it


def test_stop_rule_cuts_drafting_and_stays_exact(checkpoints, reference):
    target, draft = checkpoints["qwen3_moe"]
    # One drafter forward costs a full second: never worth it, so every tree stops at depth 1.
    profile = CostTable(tuple(0.010 + 0.0004 * k for k in range(33)), model_id="qwen3_moe", device="cpu",
                        dtype="float32", tree=(4, 8, 32), expert_model=ExpertCostModel(0.010, 0.0002, 0.0001),
                        plain_step=0.004, draft_forward=1.0)
    llm = LLM(str(target), draft_model=str(draft), policy="evict", cost_profile=profile, guard="off", draft_stop=True)
    assert llm.engine.draft_source.stop_rule is not None
    out = llm.generate([PROMPT], SamplingParams(max_tokens=20, ignore_eos=True))[0]
    assert out.token_ids == reference["qwen3_moe"]
    assert max(out.stats.acceptance_lengths) <= 2  # depth-1 trees: at most one accepted node + bonus
    off = LLM(str(target), draft_model=str(draft), policy="evict", cost_profile=profile, guard="off")
    assert off.engine.draft_source.stop_rule is None  # opt-in
    with pytest.raises(ValueError, match="cost-aware"):
        LLM(str(target), draft_model=str(draft), policy="eagle3", cost_profile=profile, draft_stop=True)
    assert LLM(str(target), draft_model=str(draft), policy="eagle3").engine.guard is None  # the fixed baseline stays fixed
    with pytest.raises(ValueError, match="guard must be one of"):
        LLM(str(target), draft_model=str(draft), policy="evict", guard="sometimes")


def test_sampling_distribution_with_plain_and_speculative_steps():
    """Invariant 2 with the switch, on moespec-tiny (its drafter accepted), one request at a time:
    step 1 plain (drafter deferred), step 2 speculative (catch-up, then a depth-1 tree: the engine cuts
    trees to max_tokens - 3 here), so the four tokens are prefill, plain, accepted-or-rejected draft, bonus."""
    tree = TreeConfig(steps=3, topk=2, max_draft_tokens=6)
    llm = LLM("moespec-tiny", policy="evict", **forced_speculation(tree=tree))
    llm.engine.guard = ScriptedGuard([False, True])
    prompt = llm.encode(["def add(a, b):\n"])[0]
    exact = exact_first_tokens(TINY_TARGET, prompt, 4, top_k=3)
    draws = draw(llm, prompt, lambda seed: SamplingParams(max_tokens=4, temperature=1.0, top_k=3, seed=seed,
                                                          ignore_eos=True), 400)
    assert draws.accepted >= 100, draws.accepted  # measured: 202 of 400
    assert_follows(draws, exact)


def test_drafter_starts_only_when_the_request_first_speculates(checkpoints, reference, monkeypatch):
    """Under the guard a request that never speculates runs no drafter forward (not even the prompt's);
    one that waits past MAX_PENDING_STEPS plain steps starts its drafter then, and stays exact."""
    from trtllm_moespec.engine import drafters

    target, draft = checkpoints["qwen3_moe"]
    llm = LLM(str(target), draft_model=str(draft), policy="evict")
    drafter = llm.engine.draft_source.drafter
    calls = []
    forward = type(drafter).forward
    drafter.forward = lambda *a, **kw: calls.append(1) or forward(drafter, *a, **kw)
    llm.engine.guard = ScriptedGuard([False])
    out = llm.generate([PROMPT], SamplingParams(max_tokens=20, ignore_eos=True))[0]
    assert out.token_ids == reference["qwen3_moe"] and calls == []
    monkeypatch.setattr(drafters, "MAX_PENDING_STEPS", 8)  # the cap, made short for the test
    params = SamplingParams(max_tokens=8 + 12, ignore_eos=True)
    llm.engine.guard = ScriptedGuard([False] * (8 + 4) + [True] * 50)
    late = llm.generate([PROMPT], params)[0]
    assert calls and any(s.speculated for s in late.steps)
    llm.engine.guard = None
    assert late.token_ids == llm.generate([PROMPT], params)[0].token_ids


def test_a_sampled_prior_declines_before_any_speculative_step_and_probes_on_the_budget():
    """With a model's prior saying a sampled speculative step commits 1.3 tokens for 2.1 plain steps, the
    engine's first sampled request measures one plain step and decodes plainly until its first budgeted
    probe (the loss of 0.8 plain steps within 0.5% of the plain time: 160 steps); the probe's step then
    counts as measured. Requests the prior does not describe learn as before."""
    from trtllm_moespec.core.sampling import SamplingConfig
    from trtllm_moespec.engine.guard import SampledPrior

    prior = SampledPrior(tokens_per_step=1.3, step_ratio=2.1, temperature=1.0)
    t1 = SamplingConfig(temperature=1.0)
    s = Guard(GuardConfig(), prior=prior).start(greedy=False, sampling=t1)
    decisions = []
    for _ in range(170):
        d = s.speculate()
        decisions.append(d)
        _feed(s, d, 1, 0.021 if d else 0.010)
    assert decisions.index(True) == 160 and decisions.count(True) == 1
    assert s.spec_s.known and s.spec_seconds() == pytest.approx(0.021)  # the probe replaced the prior's price
    # Not described by the prior: a cooler temperature, truncation, logit rules or grammar, greedy requests.
    for sampling, constrained in ((SamplingConfig(temperature=0.7), False), (SamplingConfig(1.0, top_p=0.9), False),
                                  (SamplingConfig(1.0, top_k=20), False), (t1, True)):
        state = Guard(GuardConfig(), prior=prior).start(greedy=False, sampling=sampling, constrained=constrained)
        assert state.speculate()
    assert Guard(GuardConfig(), prior=prior).start(greedy=True, sampling=SamplingConfig()).speculate()
    # A prior that says speculation pays speculates after the one plain step that prices it.
    s = Guard(GuardConfig(), prior=SampledPrior(3.0, 2.1)).start(greedy=False, sampling=t1)
    assert not s.speculate()
    _feed(s, False, 1, 0.010)
    assert s.speculate()
    with pytest.raises(ValueError, match="tokens_per_step must be a finite number >= 1"):
        SampledPrior(0.5, 2.0)
    with pytest.raises(ValueError, match="step_ratio must be a finite number > 0"):
        SampledPrior(1.3, float("nan"))


def test_moespec_base_starts_sampled_requests_from_its_prior_and_stays_lossless():
    """moespec-base ships the prior (its policy_defaults.json): a seeded T=1 request decodes exactly `ar`'s text
    (the position-keyed sampler: a token's random number depends on its seed and position only) with no
    speculative step, alone and batched; without the prior the same requests speculate to learn."""
    params = SamplingParams(max_tokens=24, temperature=1.0, seed=7, ignore_eos=True)
    ar = LLM("moespec-base", policy="ar")
    joint = LLM("moespec-base", policy="joint", target_model=ar.target)
    assert joint.engine.guard.prior is not None
    prompt = joint.encode(["def is_prime(n):\n"])[0]
    out = joint.generate([prompt], params)[0]
    assert out.token_ids == ar.generate([prompt], params)[0].token_ids
    assert not any(s.verified_tokens for s in out.steps)
    unprimed = LLM("moespec-base", policy="joint", target_model=ar.target)
    unprimed.engine.guard.prior = None
    learning = unprimed.generate([prompt], params)[0]
    assert any(s.verified_tokens for s in learning.steps)
    # Batched (several prompts: engine/batch.py), the sampled batches' guard starts from the same prior.
    prompts = [prompt, joint.encode(["import os\n"])[0]]
    batched = joint.generate(prompts, params)
    assert [o.token_ids for o in batched] == [o.token_ids for o in ar.generate(prompts, params)]
    assert not any(s.verified_tokens for o in batched for s in o.steps)
    assert any(s.verified_tokens for o in unprimed.generate(prompts, params) for s in o.steps)
