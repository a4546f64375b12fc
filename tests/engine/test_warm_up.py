"""`LLM.warm_up` / `SpecEngine.warm_up`: a process's one-time costs paid before the first request,
with no state left behind that would change what later requests do."""

from __future__ import annotations

from trtllm_moespec import LLM, SamplingParams
from trtllm_moespec.engine.batch import BatchedEngine

PROMPT = "def fibonacci(n):\n"


def test_warm_up_speculates_every_step_and_leaves_guard_and_prefix_cache_untouched():
    llm = LLM("moespec-tiny", policy="joint", prefix_cache=2)  # guard "auto": the guard is on
    ids = llm.encode([PROMPT])[0]
    requests = [llm.make_request(ids, SamplingParams(max_tokens=8, ignore_eos=True)),
                llm.make_request(ids, SamplingParams(max_tokens=8, temperature=1.0, seed=0, ignore_eos=True))]
    seconds = llm.engine.warm_up(requests)
    assert seconds > 0
    for r in requests:  # the whole speculative step ran: every decode step drafted (no guard to decline)
        assert len(r.output_ids) == 8 and r.steps and all(s.speculated for s in r.steps)
    assert sum(s.verified_tokens for r in requests for s in r.steps) > 0  # selection and verify ran on nodes too
    assert llm.engine.guard is not None and llm.engine.guard.memories == {}  # its time estimates never saw them
    assert len(llm.engine.prefix_cache) == 0  # nothing kept


def test_llm_warm_up_then_decodes_as_a_cold_llm():
    params = SamplingParams(max_tokens=24)
    cold = LLM("moespec-tiny", policy="joint")
    warm = LLM("moespec-tiny", policy="joint", target_model=cold.target)
    assert warm.warm_up(tokens=6) > 0 and warm.engine.guard.memories == {}
    assert warm.generate([PROMPT], params)[0].token_ids == cold.generate([PROMPT], params)[0].token_ids


def test_batched_warm_up_speculates_and_leaves_the_batch_guard_untouched():
    llm = LLM("moespec-tiny", policy="joint")
    batch = BatchedEngine(llm.engine, 4, batch_policy="joint-batch")  # joint-batch runs the batch guard
    ids = llm.encode([PROMPT])[0]
    requests = [llm.make_request(ids, SamplingParams(max_tokens=8, ignore_eos=True)),
                llm.make_request(ids, SamplingParams(max_tokens=8, temperature=1.0, seed=0, ignore_eos=True))]
    assert batch.warm_up(requests) > 0
    for r in requests:  # decoded together, every step speculative
        assert len(r.output_ids) == 8 and r.steps and all(s.speculated for s in r.steps)
    assert batch.num_active == 0 and batch.guard is not None
    assert batch.guard.guards == {}  # its guards saw none of those steps: none was even made
