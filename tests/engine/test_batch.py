"""The batched engine: B requests in one target forward per step, admitted and retired
between steps. Each request's output equals running it alone (greedy and seeded sampling
with per-request policies), joint-batch keeps greedy output exact and the sampling
distribution unchanged (seeded chi-square, greedy and sampled requests mixed in one batch),
and retired requests give their cache slots back."""

from __future__ import annotations

import time

import pytest
import torch
import transformers

from tests.engine.conftest import TINY_TARGET, expert_term_off, forced_speculation
from tests.engine.distribution import Draws, assert_follows, exact_first_tokens
from tests.models.conftest import count_calls
from trtllm_moespec import LLM, SamplingParams, TreeConfig
from trtllm_moespec.core.cost import ExpertCostModel
from trtllm_moespec.engine.batch import BatchedEngine, pad_layouts
from trtllm_moespec.core.cost import CostTable
from trtllm_moespec.engine.batch_cost import BatchCosts, BatchTableCosts, GoodputGuard
from trtllm_moespec.core.layout import build_layout
from trtllm_moespec.core.tree import DraftTree

PROMPTS = [[5, 17, 33, 2, 9, 100, 4], [1, 2, 3, 1, 2, 3, 1, 2], [7, 7, 8], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50]]
MAX_TOKENS = 20  # crosses the GPT-OSS test window (8)


def _drive(engine: BatchedEngine, requests, admit_every: int = 0) -> int:
    """Admit one waiting request every `admit_every` steps (continuous batching), or with 0 as many
    as fit before every step; returns the steps run."""
    waiting, steps = list(requests), 0
    while waiting or engine.num_active:
        while waiting and engine.num_active < engine.max_batch_size and (admit_every == 0 or steps % admit_every == 0):
            engine.add(waiting.pop(0))
            if admit_every:
                break
        engine.step()
        steps += 1
        assert steps < 500
    return steps


def _llm(checkpoints, arch, policy, **kw):
    target, draft = checkpoints[arch]
    return LLM(str(target), draft_model=str(draft), policy=policy, **kw)


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
@pytest.mark.parametrize("policy", ["ar", "eagle3"])
def test_each_request_equals_running_it_alone(checkpoints, arch, policy):
    llm = _llm(checkpoints, arch, policy)
    params = [SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True),
              SamplingParams(max_tokens=MAX_TOKENS - 5, temperature=0.9, top_k=20, seed=3, ignore_eos=True)]
    alone = [llm.generate([p], params[i % 2])[0].token_ids for i, p in enumerate(PROMPTS)]
    requests = [llm.make_request(p, params[i % 2]) for i, p in enumerate(PROMPTS)]
    engine = BatchedEngine(llm.engine, max_batch_size=3)
    _drive(engine, requests, admit_every=2)  # staggered: requests join a batch that is mid-way
    assert [r.output_ids for r in requests] == alone
    assert all(r.finish_reason == "length" for r in requests) and engine.num_active == 0


@pytest.fixture(scope="module")
def references_qwen(checkpoints):
    target, _ = checkpoints["qwen3_moe"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(target))
    return [hf.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None,
                        pad_token_id=0)[0, len(p):].tolist() for p in PROMPTS]


def test_greedy_batch_equals_transformers_generate(checkpoints, references_qwen):
    refs = references_qwen
    llm = _llm(checkpoints, "qwen3_moe", "joint", predictor="oracle")
    requests = [llm.make_request(p, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)) for p in PROMPTS]
    engine = BatchedEngine(llm.engine, max_batch_size=3, joint_batch=True)
    engine.run_all(requests)
    assert [r.output_ids for r in requests] == refs and engine.num_active == 0
    assert any(s.verified_tokens > 0 for r in requests for s in r.steps)  # it did speculate


def test_plain_steps_defer_the_drafter_and_stay_exact(checkpoints, references_qwen):
    """joint-batch alternating plain and speculative steps: plain steps skip the drafter, which
    catches up in one extend before the next draft; greedy output stays transformers'."""
    llm = _llm(checkpoints, "qwen3_moe", "joint", predictor="oracle")
    requests = [llm.make_request(p, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)) for p in PROMPTS]
    guard = GoodputGuard(alpha=1.0, probe_every=2, max_probe_every=2, probe_overhead=0.99)
    engine = BatchedEngine(llm.engine, max_batch_size=4, joint_batch=True, goodput_guard=guard)
    engine.run_all(requests)
    assert [r.output_ids for r in requests] == references_qwen
    assert {(4, True), (4, False)} <= set(guard._goodput)  # both modes ran at batch size 4


class _Scripted(GoodputGuard):
    """A guard that speculates on the listed engine steps only (the schedule is the test's input; no scouts)."""

    def __init__(self, speculative_steps: set[int]):
        super().__init__(scout_every=0)
        self.speculative_steps, self.step = speculative_steps, 0

    def speculate(self, batch_size: int, greedy: bool = False) -> bool:
        self.step += 1
        return self.step in self.speculative_steps


def _count_drafter_forwards(llm, monkeypatch) -> list[int]:
    return count_calls(monkeypatch, llm.engine.draft_source.drafter, "forward")


def test_plain_batch_steps_run_no_drafter_forward(checkpoints, references_qwen, monkeypatch):
    """A batch that never speculates never runs the drafter (not even its prompt prefill)."""
    llm = _llm(checkpoints, "qwen3_moe", "joint", predictor="oracle")
    calls = _count_drafter_forwards(llm, monkeypatch)
    requests = [llm.make_request(p, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)) for p in PROMPTS]
    BatchedEngine(llm.engine, max_batch_size=4, joint_batch=True, goodput_guard=_Scripted(set())).run_all(requests)
    assert [r.output_ids for r in requests] == references_qwen and calls[0] == 0


def test_a_batch_drafts_with_one_drafter_forward_per_drafting_step(checkpoints, monkeypatch):
    """B requests speculating together: each drafting step is one packed drafter forward for all
    of them, and their accepted tokens go to the drafter in one more (not B of each)."""
    llm = _llm(checkpoints, "qwen3_moe", "eagle3", tree=TreeConfig(steps=3, topk=2, max_draft_tokens=6))
    forwards = count_calls(monkeypatch, llm.engine.draft_source.drafter, "_forward_fused")
    requests = [llm.make_request(p, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)) for p in PROMPTS[:3]]
    engine = BatchedEngine(llm.engine, max_batch_size=3)
    for r in requests:
        engine.add(r)
    engine.step()  # prefills; each request's drafter takes its prompt
    assert forwards[0] == 3
    for _ in range(3):
        forwards[0] = 0
        outputs, _ = engine.step()
        assert len(outputs) == 3 and not any(o.finished for o in outputs)
        assert forwards[0] == 3  # two drafting steps + one commit, for the three requests


@pytest.mark.parametrize("schedule", [{6, 7, 12}, {2, 16, 17, 18}, {36, 38, 39}])
def test_a_drafter_started_late_catches_up_exactly(checkpoints, references_qwen, monkeypatch, schedule):
    """Plain steps first, the drafter started at the batch's first speculative step (prompt prefill,
    then the missed plain steps in one catch-up), including a request past the early-step cap."""
    from trtllm_moespec.engine import drafters

    monkeypatch.setattr(drafters, "MAX_PENDING_STEPS", 32)  # the cap, made short for the test
    llm = _llm(checkpoints, "qwen3_moe", "joint", predictor="oracle")
    calls = _count_drafter_forwards(llm, monkeypatch)
    requests = [llm.make_request(p, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)) for p in PROMPTS]
    long = llm.make_request(PROMPTS[0], SamplingParams(max_tokens=45, ignore_eos=True))  # 32 early steps + more
    engine = BatchedEngine(llm.engine, max_batch_size=3, joint_batch=True, goodput_guard=_Scripted(schedule))
    _drive(engine, [long] + requests, admit_every=3)
    assert [r.output_ids for r in requests] == references_qwen
    assert long.output_ids[:MAX_TOKENS] == references_qwen[0]
    assert calls[0] > 0 and any(s.verified_tokens > 0 for r in requests + [long] for s in r.steps)


@pytest.mark.parametrize("policy", ["evict", "ecospec"])
def test_batch_variants_keep_greedy_output_exact(checkpoints, references_qwen, policy):
    """evict-batch / ecospec-batch: nodes chosen across the batch, requests joining mid-way;
    every request still decodes exactly what transformers' greedy generate does."""
    llm = _llm(checkpoints, "qwen3_moe", policy, predictor="oracle")
    requests = [llm.make_request(p, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)) for p in PROMPTS]
    # evict's costs made cheap per node (the random test drafter rarely pays): the test is about exactness
    # when many nodes of several requests are verified.
    costs = BatchTableCosts(CostTable((1.0,) + tuple(1.0 + 1e-6 * k for k in range(1, 33))), measure=False)
    engine = BatchedEngine(llm.engine, max_batch_size=3, batch_policy=f"{policy}-batch", goodput_guard=False,
                           costs=costs if policy == "evict" else None)
    _drive(engine, requests, admit_every=2)
    assert [r.output_ids for r in requests] == references_qwen and engine.num_active == 0
    assert any(s.verified_tokens > 0 for r in requests for s in r.steps)  # it did speculate
    assert engine.guard is None and (engine.costs is None) == (policy == "ecospec")


def test_batch_policy_needs_its_loaded_policy(checkpoints):
    llm = _llm(checkpoints, "qwen3_moe", "eagle3")
    with pytest.raises(ValueError, match="policy 'evict'"):
        BatchedEngine(llm.engine, 2, batch_policy="evict-batch")
    with pytest.raises(ValueError, match="unknown batch policy"):
        BatchedEngine(llm.engine, 2, batch_policy="eagle3-batch")
    with pytest.raises(ValueError, match="contradicts"):
        BatchedEngine(llm.engine, 2, joint_batch=True, batch_policy="evict-batch")


def test_a_batch_of_guarded_requests_is_guarded(checkpoints):
    """Without a batch policy the batch follows the loaded engine's guard: a cost-aware policy served
    batched falls back to plain batches where speculation loses (eagle3 and guard="off" stay unguarded)."""
    joint = _llm(checkpoints, "qwen3_moe", "joint", predictor="oracle")
    assert joint.engine.guard is not None and BatchedEngine(joint.engine, 4).guard is not None
    assert BatchedEngine(joint.engine, 4, goodput_guard=False).guard is None
    for kw in ({"policy": "eagle3"}, {"policy": "joint", "predictor": "oracle", "guard": "off"}):
        llm = _llm(checkpoints, "qwen3_moe", **kw)
        assert llm.engine.guard is None and BatchedEngine(llm.engine, 4).guard is None
    # A speculative step that loses to plain decoding: the guard decides the batch's next steps plainly.
    engine = BatchedEngine(joint.engine, 4)
    greedy = engine.guard.of(True, [])  # greedy batches' guard (sampled ones have their own: GuardsByKind)
    for _ in range(greedy.min_spec_steps):
        greedy.record(2, True, 2, 0.100)
    greedy.record(2, False, 2, 0.010)
    requests = [joint.make_request(p, SamplingParams(max_tokens=6, ignore_eos=True)) for p in PROMPTS[:2]]
    _drive(engine, requests)
    assert all(not s.verified_tokens for r in requests for s in r.steps)


class _Recording(_Scripted):
    """A scripted guard that keeps what the engine reports for each step."""

    def __init__(self, speculative_steps: set[int]):
        super().__init__(speculative_steps)
        self.records: list[tuple[int, bool, int, float]] = []

    def record(self, batch_size: int, speculated: bool, tokens: int, seconds: float, greedy: bool = False) -> None:
        self.records.append((batch_size, speculated, tokens, seconds))


def test_the_guard_times_the_iteration_without_the_prefills_beside_it(checkpoints, monkeypatch):
    """Requests admitted mid-way prefill in the same engine step as the running ones iterate; the
    guard must not charge those prefills to the step's mode (they would bias it at random)."""
    llm = _llm(checkpoints, "qwen3_moe", "joint", predictor="oracle")
    # a process's one-time costs (compiled kernels loading) are paid before, as a server does
    llm.engine.warm_up([llm.make_request(PROMPTS[0], SamplingParams(max_tokens=4, ignore_eos=True))])
    prefill = llm.target.prefill

    def slow_prefill(*args, **kwargs):
        time.sleep(0.3)
        return prefill(*args, **kwargs)

    monkeypatch.setattr(llm.target, "prefill", slow_prefill)
    guard = _Recording({3, 4, 8})
    requests = [llm.make_request(p, SamplingParams(max_tokens=8, ignore_eos=True)) for p in PROMPTS]
    t0 = time.perf_counter()
    _drive(BatchedEngine(llm.engine, max_batch_size=4, joint_batch=True, goodput_guard=guard), requests, admit_every=2)
    assert time.perf_counter() - t0 > 0.3 * len(PROMPTS)
    assert len(guard.records) > len(PROMPTS) and {spec for _, spec, _, _ in guard.records} == {True, False}
    assert max(seconds for *_, seconds in guard.records) < 0.25  # no step carries a 0.3 s prefill


def test_abort_frees_the_slot_and_slots_are_reused(checkpoints):
    llm = _llm(checkpoints, "qwen3_moe", "eagle3")
    engine = BatchedEngine(llm.engine, max_batch_size=2)
    first = llm.make_request(PROMPTS[0], SamplingParams(max_tokens=200, ignore_eos=True))
    engine.add(first)
    engine.step()
    engine.step()
    engine.abort(first)
    assert engine.num_active == 0
    requests = [llm.make_request(p, SamplingParams(max_tokens=6, ignore_eos=True)) for p in PROMPTS]
    _drive(engine, requests)
    pool = getattr(llm.target, "_pool", None)
    if pool is not None:  # the static cache: never more slots than the batch needed, all free again
        assert pool.num_slots <= 4 and len(pool._free) == pool.num_slots
    # drafter K/V buffers too: one per request alive at once (their CUDA graphs are kept per buffer)
    assert llm.engine.draft_source.drafter.kv_pool.allocated <= 2
    with pytest.raises(ValueError, match="full"):
        for r in requests[:3]:
            engine.add(r)


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_prompts_prefilled_together_equal_prefilled_alone(checkpoints, arch):
    """prefill_batch: prompts of different lengths (right-padded to the longest, past the GPT-OSS test
    window of 8) in one forward give each prompt's own prefill (last logits, every hidden and expert
    id), and the caches continue as the single ones do (the padding's keys are overwritten)."""
    from trtllm_moespec.core.layout import root_layout
    from trtllm_moespec.engine.batch import prefill_batch

    target = _llm(checkpoints, arch, "ar").target
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 128, (1, n), generator=gen) for n in (5, 17, 11)]
    together = [target.new_cache() for _ in prompts]
    outs = prefill_batch(target, together, prompts)
    for p, c, out in zip(prompts, together, outs):
        alone = target.new_cache()
        ref = target.prefill(alone, p)
        assert c.num_tokens == alone.num_tokens == p.shape[1]
        torch.testing.assert_close(out.logits, ref.logits, atol=2e-5, rtol=0)
        torch.testing.assert_close(out.hidden, ref.hidden, atol=2e-5, rtol=0)
        assert torch.equal(out.expert_ids, ref.expert_ids)
        for tok in (3, 9):  # the next steps: the padding past the prompt must not leak into them
            layout = root_layout(torch.tensor([tok]))
            a, b = target.verify(c, layout), target.verify(alone, layout)
            torch.testing.assert_close(a.logits, b.logits, atol=2e-5, rtol=0)
            for cache in (c, alone):
                target.commit(cache, torch.tensor([-1]))


def test_pad_layouts_pads_with_the_root_seeing_only_itself():
    tree = DraftTree.from_parents(torch.tensor([[4, 5, 6]]), torch.tensor([[-1, 0, -1]]), torch.full((1, 3), 0.5))
    big = build_layout(tree, torch.tensor([[0, 1, 2]]), torch.tensor([9]))
    small = build_layout(DraftTree.empty(1), torch.zeros(1, 0, dtype=torch.int64), torch.tensor([3]))
    stacked = pad_layouts([small, big])
    assert stacked.token_ids.tolist() == [[3, 3, 3, 3], [9, 4, 5, 6]]
    assert stacked.depth.tolist() == [[0, 0, 0, 0], [0, 1, 2, 1]]
    mask = stacked.tree_mask()
    assert mask[0].tolist() == [[True, False, False, False]] * 4  # pads see the root only
    assert torch.equal(mask[1], big.tree_mask()[0])
    assert stacked.num_nodes.tolist() == [0, 3]


@pytest.mark.slow
def test_joint_batch_sampling_keeps_the_target_distribution():
    """Mixed batches on moespec-tiny (its drafter accepted): a greedy request (must equal the greedy
    output) beside 3 sampled ones, joint-batch selecting over all four."""
    tree = TreeConfig(steps=2, topk=3, max_draft_tokens=6)
    llm = LLM("moespec-tiny", policy="joint", **forced_speculation(tree=tree))
    prompt, top_k, length = llm.encode(["def add(a, b):\n"])[0], 3, 3
    exact = exact_first_tokens(TINY_TARGET, prompt, length, top_k=top_k)
    greedy_ref = llm.generate([prompt], SamplingParams(max_tokens=length, ignore_eos=True))[0].token_ids
    # Costs that make every node worth verifying, and no guard: the test is about acceptance, so the
    # selection must verify nodes of several requests in each batch.
    costs = BatchCosts(ExpertCostModel(c0=1.0, c_tok=1e-6, c_exp=1e-6), measure=False)
    engine = BatchedEngine(llm.engine, max_batch_size=4, joint_batch=True, costs=costs, goodput_guard=False)
    counts: dict[tuple[int, ...], int] = {}
    trials, accepted = 240, 0
    for t in range(trials // 3):
        sampled = [llm.make_request(prompt, SamplingParams(max_tokens=length, temperature=1.0, top_k=top_k,
                                                           seed=3 * t + i, ignore_eos=True)) for i in range(3)]
        greedy = llm.make_request(prompt, SamplingParams(max_tokens=length, ignore_eos=True))
        _drive(engine, [sampled[0], greedy, sampled[1], sampled[2]])  # all four in one batch
        assert greedy.output_ids == greedy_ref
        for r in sampled:
            counts[tuple(r.output_ids)] = counts.get(tuple(r.output_ids), 0) + 1
            accepted += sum(s.accepted_tokens for s in r.steps)
    assert accepted >= 90, accepted  # measured: 179 of 240
    assert_follows(Draws(counts, trials, accepted, 0), exact)


@pytest.mark.parametrize("policy", ["ar", "eagle3", "joint"])
def test_llm_generate_decodes_several_prompts_together_as_one_by_one(policy, monkeypatch):
    """`LLM.generate` with several prompts runs them through the batched engine (fewer prompts than
    `max_batch_size` and more): the same tokens, text (a stop string's cut applied), finish reasons and
    logprobs as `max_batch_size=1`, which decodes them one at a time."""
    llm = LLM("moespec-tiny", policy=policy)
    prompts = ["def add(a, b):\n", "import os\n", "class Stack:\n", "for i in range(10):\n", "# a comment\n"]
    alone = llm.generate(prompts, SamplingParams(max_tokens=24, logprobs=1), max_batch_size=1)
    stop = alone[1].text[4:6]  # ends the second prompt's output early, inside the batch
    params = SamplingParams(max_tokens=24, logprobs=1, stop=[stop])
    alone = llm.generate(prompts, params, max_batch_size=1)
    assert alone[1].finish_reason == "stop"
    calls = count_calls(monkeypatch, BatchedEngine, "step")
    for max_batch_size in (16, 2):
        together = llm.generate(prompts, params, max_batch_size=max_batch_size)
        for a, b in zip(alone, together):
            assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason)
            assert [e.logprob for e in a.logprobs] == pytest.approx([e.logprob for e in b.logprobs], abs=1e-4)
    assert calls[0] > 0
    with pytest.raises(ValueError, match="max_batch_size must be a positive integer"):
        llm.generate(prompts, params, max_batch_size=0)


def test_max_depths_read_every_request_in_one_transfer():
    """The batched CUDA step's one read before the verify (run here on CPU tensors): each request's
    deepest selected node, 0 when nothing is selected, None when it did not draft; the layouts built
    with these depths equal those built by the checked path."""
    from trtllm_moespec.core.layout import _build_layout_tensors, build_layout
    from trtllm_moespec.core.tree import DraftTree
    from trtllm_moespec.engine.batch import _max_depths
    from trtllm_moespec.engine.drafters import Draft

    parents = torch.tensor([[-1, 0, 1, -1, 3, 4, 5, 0, 7, 8]])
    tree = DraftTree.from_parents(torch.arange(10)[None], parents, torch.full((1, 10), 0.5))
    draft = Draft(tree, None)
    selections = [torch.tensor([[0, 1, 2, 3, -1]]), torch.tensor([[3, 4, 5, 6]]), torch.zeros(1, 0, dtype=torch.int64),
                  torch.tensor([[0, 7, -1]]), torch.zeros(1, 0, dtype=torch.int64)]
    depths = _max_depths([draft, draft, draft, draft, None], selections)
    assert depths == [3, 4, 0, 2, None]
    root = torch.tensor([42])
    for node_idx, depth in zip(selections[:4], depths):
        want = build_layout(tree, node_idx, root)  # the host path
        got = _build_layout_tensors(tree, node_idx, root, depth)
        for name in ("token_ids", "parent_pos", "depth", "valid", "num_nodes"):
            assert torch.equal(getattr(got, name), getattr(want, name)), name


def test_joint_batch_without_its_expert_term_selects_as_evict_batch(checkpoints, references_qwen):
    """Where the profile says joint's expert term cannot pay, joint-batch selects as evict-batch on the
    measured C(k) (no predictor loaded) and every request stays exact."""
    llm = _llm(checkpoints, "qwen3_moe", "joint", predictor="oracle", **expert_term_off("qwen3_moe"))
    requests = [llm.make_request(p, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)) for p in PROMPTS]
    engine = BatchedEngine(llm.engine, max_batch_size=3, batch_policy="joint-batch", goodput_guard=False)
    assert llm.engine.predictor is None and isinstance(engine.costs, BatchTableCosts)
    _drive(engine, requests, admit_every=2)
    assert [r.output_ids for r in requests] == references_qwen
    assert any(s.verified_tokens > 0 for r in requests for s in r.steps)
