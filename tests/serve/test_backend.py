"""The Executor backend on the batched engine: concurrent generate() calls from several threads
share one continuous batch and return exactly LLM.generate's outputs; stream() adds up to them."""

from __future__ import annotations

import threading

from trtllm_moespec import SamplingParams
from trtllm_moespec.serve.backend import BatchedBackend

PROMPTS = ["def add(a, b):\n", "import os\n", "class Stack:\n", "for i in range(10):\n"]


def test_threads_share_the_batch_and_get_single_request_outputs(tiny_llm):
    params = SamplingParams(max_tokens=10, temperature=0.0)
    expected = [o.token_ids for o in tiny_llm.generate(PROMPTS, params)]
    backend = BatchedBackend(tiny_llm, max_batch_size=4)
    results: dict[int, list] = {}
    try:
        threads = [threading.Thread(target=lambda k=k: results.__setitem__(k, backend.generate(PROMPTS[2 * k:2 * k + 2],
                                                                                            params)))
                   for k in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        outputs = results[0] + results[1]
        assert [o.token_ids for o in outputs] == expected
        assert all(o.finish_reason == "length" and o.stats.num_tokens == 10 for o in outputs)
        events = list(backend.stream(PROMPTS[0], params))
        assert "".join(e.text for e in events) == events[-1].output.text == tiny_llm.generate([PROMPTS[0]], params)[0].text
        assert backend.scheduler.metrics.batch_size_sum > backend.scheduler.metrics.engine_steps  # batches of > 1
    finally:
        backend.shutdown()
    assert not backend.scheduler.alive
