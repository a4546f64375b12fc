"""What `LLM.generate`, `LLM.chat` and `LLM.stream` return, in the shape of vLLM's and TensorRT-LLM's
LLM API: a `RequestOutput` per prompt holding its `outputs` (one `CompletionOutput` per sampled
completion, `SamplingParams.n` of them), and `StreamEvent`s while a completion is decoded.

    out = llm.generate(["def fib(n):"], SamplingParams(n=2, temperature=1.0, seed=0))[0]
    out.outputs[1].text, out.outputs[1].token_ids, out.outputs[1].finish_reason
    out.text  # the first completion's, as before n existed (out.outputs[0].text)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from .core.logprobs import TokenLogprob
from .engine.stats import GenerationStats, StepStats

if TYPE_CHECKING:
    from .engine.engine import Request

__all__ = ["CompletionOutput", "RequestOutput", "StreamEvent"]


@dataclass(frozen=True)
class CompletionOutput:
    """One completion of a prompt (vLLM's / TensorRT-LLM's `CompletionOutput`), with our decoding stats."""

    index: int  # which of the prompt's n completions
    text: str  # "" when the model has no tokenizer
    token_ids: list[int]
    finish_reason: str  # "length" | "stop"
    stats: GenerationStats
    steps: tuple[StepStats, ...] = ()  # per-iteration records
    logprobs: tuple[TokenLogprob, ...] | None = None  # one per token of token_ids when SamplingParams.logprobs is set

    @property
    def cumulative_logprob(self) -> float | None:
        """Sum of the tokens' logprobs (raw target distribution); None without SamplingParams.logprobs."""
        return None if self.logprobs is None else float(sum(e.logprob for e in self.logprobs))

    @staticmethod
    def of(request: "Request", text: str, index: int = 0) -> "CompletionOutput":
        """The completion of a finished engine request whose text (a stop string's cut applied) is `text`."""
        return CompletionOutput(index, text, list(request.output_ids), request.finish_reason or "length",
                                request.stats(), tuple(request.steps),
                                None if request.logprobs is None else tuple(request.output_logprobs))


@dataclass(frozen=True)
class RequestOutput:
    """A prompt's outputs. `text`, `token_ids`, `finish_reason`, `stats`, `steps` and `logprobs` are the
    first completion's (`outputs[0]`), the attributes this class had before `SamplingParams.n`."""

    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    prompt: str | None = None  # the prompt's text, when it was given as text
    # one per prompt token when SamplingParams.prompt_logprobs is set; None first (the first token has no context)
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
    finished: bool = True  # vLLM's flag: every output here is final

    def __post_init__(self) -> None:
        if not self.outputs:
            raise ValueError("a RequestOutput holds at least one completion")

    @staticmethod
    def of(request: "Request", text: str, prompt: str | None = None) -> "RequestOutput":
        """The output of one finished engine request whose text (a stop string's cut applied) is `text`."""
        return RequestOutput.of_completions([request], [text], prompt)

    @staticmethod
    def of_completions(requests: Sequence["Request"], texts: Sequence[str], prompt: str | None = None
                       ) -> "RequestOutput":
        """The output of a prompt's n finished requests (the same prompt each), in completion order."""
        first = requests[0]
        return RequestOutput(list(first.prompt_ids), [CompletionOutput.of(r, t, i) for i, (r, t) in
                                                      enumerate(zip(requests, texts))], prompt,
                             None if first.prompt_logprobs is None else (None, *first.prompt_token_logprobs))

    # ------------------------------------------------------------- the first completion's (outputs[0])
    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str:
        return self.outputs[0].finish_reason

    @property
    def stats(self) -> GenerationStats:
        return self.outputs[0].stats

    @property
    def steps(self) -> tuple[StepStats, ...]:
        return self.outputs[0].steps

    @property
    def logprobs(self) -> tuple[TokenLogprob, ...] | None:
        return self.outputs[0].logprobs


@dataclass(frozen=True)
class StreamEvent:
    """What `LLM.stream` yields: the text and tokens one engine step committed, as deltas.

    `text` is the new text (TensorRT-LLM's `text_diff`; joined, the events' texts equal the final
    text: an incomplete UTF-8 character, or what may still turn out to begin a stop string, is held
    back until it is settled), `token_ids` the new tokens (`token_ids_diff`). The last event has
    `finished` set and carries the whole `output` (a RequestOutput); it may carry text too.

        for event in llm.stream("def fib(n):", SamplingParams(max_tokens=64)):
            print(event.text, end="", flush=True)
    """

    token_ids: list[int]
    text: str
    output: RequestOutput | None = None
    logprobs: tuple[TokenLogprob, ...] = ()  # of token_ids, when SamplingParams.logprobs is set

    @property
    def finished(self) -> bool:
        """The last event of the stream (its `output` is set)."""
        return self.output is not None

    @property
    def text_diff(self) -> str:
        """TensorRT-LLM's name for the new text (`text`)."""
        return self.text

    @property
    def token_ids_diff(self) -> list[int]:
        """TensorRT-LLM's name for the new tokens (`token_ids`)."""
        return self.token_ids
