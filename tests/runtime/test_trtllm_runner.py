"""The Executor's TensorRT-LLM runner (issue 26 F5): requests go through `generate_async`, all in flight at
once, and streams carry each response's new tokens.

The LLM is replaced by an object with TensorRT-LLM's `generate_async` contract (a GenerationResult that
`result()` waits for and that iterates once per response, outputs cumulative: tensorrt_llm/executor/result.py
@ a678b91aafbeff265cd0b764abb59d7def624ac2); the runner's own logic runs for real.
"""

import threading
from types import SimpleNamespace

from trtllm_moespec import SamplingParams
from trtllm_moespec.runtime.executor import TrtllmRunner


class _Result:
    """A GenerationResult: iterating it waits for the next response; outputs are cumulative."""

    def __init__(self, log, prompt, pieces, streaming):
        self.log, self.prompt, self.pieces, self.streaming = log, prompt, pieces, streaming
        self.finished, self._n = False, 0
        self.outputs = [SimpleNamespace(text="", token_ids=[], request_perf_metrics=SimpleNamespace(
            speculative_decoding=SimpleNamespace(total_accepted_draft_tokens=2, total_draft_tokens=16)))]

    def _step(self):
        text, ids = self.pieces[self._n]
        out = self.outputs[0]
        out.text, out.token_ids = out.text + text, out.token_ids + ids
        self._n += 1
        self.finished = self._n == len(self.pieces)

    def result(self):
        self.log.append(("wait", self.prompt))
        while not self.finished:
            self._step()
        return self

    def __iter__(self):
        while not self.finished:
            self._step()
            yield self


class _LLM:
    def __init__(self):
        self.log, self.shut = [], False

    def generate_async(self, prompt, params, streaming=False):
        self.log.append(("submit", prompt))
        return _Result(self.log, prompt, [(" a", [1, 2]), (" b", [3]), ("", [4])], streaming)

    def shutdown(self):
        self.shut = True


def test_generate_puts_every_prompt_in_flight_before_waiting():
    llm = _LLM()
    runner = TrtllmRunner(llm, lambda **kw: SimpleNamespace(**kw))
    outputs = runner.generate(["p", "q"], SamplingParams(max_tokens=4))
    assert llm.log == [("submit", "p"), ("submit", "q"), ("wait", "p"), ("wait", "q")]
    assert [o.text for o in outputs] == [" a b"] * 2 and outputs[0].token_ids == [1, 2, 3, 4]
    assert (outputs[0].stats.num_steps, outputs[0].stats.mean_accepted_tokens) == (2, 2.0)  # 4 tokens, 2 drafts
    assert runner.batched


def test_stream_yields_each_response_and_ends_with_the_output():
    llm = _LLM()
    runner = TrtllmRunner(llm, lambda **kw: SimpleNamespace(**kw))
    events = list(runner.stream("p", SamplingParams(max_tokens=4)))
    assert [e.text for e in events] == [" a", " b", ""] and [e.token_ids for e in events] == [[1, 2], [3], [4]]
    assert events[-1].output is not None and events[-1].output.text == " a b"
    assert all(e.output is None for e in events[:-1])
    assert "".join(e.text for e in events) == events[-1].output.text


def test_concurrent_callers_reach_tensorrt_llm_together():
    """Two threads (the Triton model's request threads) both submit before either result is read."""
    barrier = threading.Barrier(2)

    class Gate(_LLM):
        def generate_async(self, prompt, params, streaming=False):
            result = super().generate_async(prompt, params, streaming)
            barrier.wait(timeout=10)  # each submit waits for the other: sequential callers would deadlock here
            return result

    llm = Gate()
    runner = TrtllmRunner(llm, lambda **kw: SimpleNamespace(**kw))
    threads = [threading.Thread(target=runner.generate, args=([p], SamplingParams(max_tokens=4))) for p in "pq"]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    assert sorted(x for x in llm.log if x[0] == "submit") == [("submit", "p"), ("submit", "q")]
